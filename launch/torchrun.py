"""torchrun that keeps a failed rank's exit code and says in one line which rank failed.

    python -m launch.torchrun --standalone --nproc-per-node 4 -m launch.train --config configs/smoke.yaml

torchrun ends a run in which a worker failed with its ChildFailedError block (a traceback and a table of every
failed rank) and exit code 1, so a config error (78), a preemption (75) or a full disk (74) reads as a crash to
whatever launched it (make smoke, a job script, a scheduler). Here torch's own launcher runs the workers as torchrun
would (torch.distributed.run.run: the same arguments, rendezvous and restarts); a failure ends in one line naming
the first rank that failed, its host and its exit code, and the exit is that code (128 + N for a worker killed by
signal N). The worker's own line saying why is already on stderr. For `-m launch.train` the config is read here
first: a bad one is refused once, in launch.train's line, before any process starts.
"""

import socket
import sys

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from launch import train as training
from moe_pretrain.config import EX_CONFIG, ConfigError, load_config_from_args


def exit_code(code: int) -> int:
    """A worker's exit code as a shell reports it: a signal N (torch's -N) as 128 + N."""
    return 128 - code if code < 0 else code


def main(argv: list[str] | None = None) -> int:
    args = torchrun.parse_args(argv if argv is not None else sys.argv[1:])
    if args.module and args.training_script == "launch.train":
        try:
            load_config_from_args(training.parse(args.training_script_args))
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return EX_CONFIG
    try:
        torchrun.run(args)
    except ChildFailedError as err:  # the failed ranks are this agent's, on this host
        rank, failure = err.get_first_failure()
        code = exit_code(failure.exitcode)
        others = len(err.failures) - 1
        after = f"; {others} more rank{'s' if others > 1 else ''} failed after it" if others else ""
        print(f"launch.torchrun: rank {rank} (local rank {failure.local_rank} on {socket.gethostname()}) exited with "
              f"{code}{after}: exit {code}", file=sys.stderr)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
