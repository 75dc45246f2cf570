"""torchrun that keeps a failed rank's exit code and says in one line which rank failed.

    python -m launch.torchrun --standalone --nproc-per-node 4 -m launch.train --config configs/smoke.yaml

torchrun ends a run in which a worker failed with its ChildFailedError block (a traceback and a table of every
failed rank) and exit code 1, so a config error (78), a preemption (75) or a full disk (74) reads as a crash to
whatever launched it (make smoke, a job script, a scheduler). Here torch's own launcher runs the workers as torchrun
would (torch.distributed.run.run: the same arguments, rendezvous and restarts); a failure ends in one line naming
the first rank that failed, its host and its exit code, and the exit is that code (128 + N for a worker killed by
signal N). The worker's own line saying why is already on stderr. For `-m launch.train` the config is read here
first: a bad one is refused once, in launch.train's line, before any process starts.

A node's agent that loses the rendezvous (the node hosting its store, the head node under SLURM, died, or another
node's agent closed it as it ended) ends in one line naming the endpoint, and exits with the code of the status.json
its run wrote since this launch began, else 77 (LOST_PEER: a node is gone), where torchrun would print the store's
error and a traceback and exit 1.

A signal torchrun handles (--signals-to-handle: the job script forwards SLURM's preemption and time-limit signals)
is passed to the workers, which save and exit; torchrun then raises its SignalException, a traceback and exit 1.
Here that is one line, and the exit is the run's own as the status.json it wrote since this launch began says
(75 for a preemption), else 128 + the signal's number.
"""

import signal
import socket
import sys
import time
from pathlib import Path

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError

from launch import train as training
from moe_pretrain.config import EX_CONFIG, Config, ConfigError, load_config_from_args
from moe_pretrain.operations.outcome import LOST_PEER, read_record


def exit_code(code: int) -> int:
    """A worker's exit code as a shell reports it: a signal N (torch's -N) as 128 + N."""
    return 128 - code if code < 0 else code


def run_status_since(cfg: Config | None, started: float) -> tuple[int, str] | None:
    """(exit code, state) of the status.json the run wrote since `started`; None without one."""
    status = read_record(Path(cfg.train.run_dir) / "status.json", written_since=started) if cfg else {}
    if not isinstance(status.get("exit_code"), int):
        return None
    return status["exit_code"], str(status.get("state"))


def main(argv: list[str] | None = None) -> int:
    args = torchrun.parse_args(argv if argv is not None else sys.argv[1:])
    started, cfg = time.time(), None
    if args.module and args.training_script == "launch.train":
        try:
            cfg = load_config_from_args(training.parse(args.training_script_args))
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return EX_CONFIG
    try:
        torchrun.run(args)
    except SignalException as err:  # torchrun passed it to the workers and waited for them to end
        name = signal.Signals(err.sigval).name
        status = run_status_since(cfg, started)
        code, how = (status[0], f"the run ended {status[1]}") if status else (128 + err.sigval, "no status written")
        print(f"launch.torchrun: {name} received and passed to the workers; {how}: exit {code}", file=sys.stderr)
        return code
    except RendezvousError as err:  # another node's agent is gone, or closed the rendezvous as it ended
        status = run_status_since(cfg, started)
        code, how = (status[0], f"the run ended {status[1]}") if status else (LOST_PEER, "no status written")
        cause = f": {err.__cause__}" if err.__cause__ else ""
        print(f"launch.torchrun: lost the rendezvous at {args.rdzv_endpoint} ({type(err).__name__}{cause}): the "
              f"node hosting it, or another node's agent, is gone; {how}: exit {code}", file=sys.stderr)
        return code
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
