"""What the job script does once training has ended: the lines of shell after srun (launch/slurm.py renders them).

The state comes from <run_dir>/status.json, read by the shell alone (a container setup may have no Python on the
batch host), when the record is this launch's own ($MOE_PRETRAIN_LAUNCH_ID, set by the script for each run):
finished -> exit 0; preempted (a signal or the clock stop) -> requeue, without limit; failed (bad
config or data: permanent) -> exit 78; storage_full (the checkpoint file system) -> exit 74; interrupted (Ctrl-C) ->
exit 130; this launch refused (run_dir/refused.json of its launch id: the directory is another live run's, or the
checkpoint another model's) -> exit 78, status.json being the run's own; a refusal of another launch (by hand beside
the live run) does not count. Anything else (hung, a lost peer, a crash torchrun could not restart away,
no status at all) may be a sick node, and the same allocation would meet it again: every node runs the node check
(launch.node_check, by default launch/node_check.py) under srun, and a node that fails it or does not answer within
NODE_CHECK_TIMEOUT_S joins the job's ExcNodeList as it requeues (held while the list changes: SLURM refuses to
change a running job's); unless all of several nodes fail, a shared cause. Such requeues are counted in
<run_dir>/slurm-<job>.failures, one line each: past launch.max_requeues the job ends with the run's exit code, left
to a person (a bug fails on every node alike).
"""

import shlex
from pathlib import Path

from moe_pretrain.config import LaunchConfig
from moe_pretrain.operations.outcome import (
    FINISHED,
    INTERRUPTED,
    LAUNCH_ID_VARIABLE,
    PERMANENT,
    REFUSED,
    REFUSED_FILE,
    REQUEUE,
    STATES,
    STORAGE_FULL,
)
from moe_pretrain.operations.stragglers import SLOW_HOSTS_FILE

NODE_CHECK_TIMEOUT_S = 300
"""The node check's time on every node together (CUDA start-up and one product per GPU take seconds)."""

EXCLUDE_WITHIN_S = 20
"""Seconds the held job's ExcNodeList update is retried before the job is released: well within SLURM's default
KillWait (30 s), after which the script that must release it is killed."""


def node_check_command(launch: LaunchConfig, gpus_per_node: int, run_dir: Path) -> list[str]:
    if launch.node_check:
        return shlex.split(launch.node_check)
    return [launch.python, "-m", "launch.node_check", f"--gpus={gpus_per_node}", f"--dir={run_dir}"]


def outcome_lines(launch: LaunchConfig, gpus_per_node: int, run_dir: Path, container: str) -> list[str]:
    """Shell lines run after srun returned with $code; $run_dir is set."""
    q = shlex.quote
    check = " ".join(q(word) for word in node_check_command(launch, gpus_per_node, run_dir))
    # bash -c runs on each node (in the container, if any): the node marks itself fit in the check directory.
    on_node = q(f'{check} && touch "$1/$SLURMD_NODENAME"')
    return [
        # status.json holds one '"state": "<word>",' line.
        "# The job's ExcNodeList as slurmctld holds it now, one host a line ((null) and compressed lists expanded).",
        "excluded_now() {",
        '  list=$(scontrol show job "$SLURM_JOB_ID" | sed -n \'s/.*ExcNodeList=\\([^ ]*\\).*/\\1/p\' | head -n 1)',
        '  case "$list" in ""|"(null)") ;; *) scontrol show hostnames "$list" ;; esac',
        "}",
        "# 0 when every sick host is in the job's ExcNodeList.",
        "all_excluded() {",
        '  held=$(excluded_now)',
        '  for host in $(scontrol show hostnames "$sick"); do',
        '    printf "%s\\n" "$held" | grep -qx "$host" || return 1',
        "  done",
        "}",
        "# Requeue the job with the hosts in $sick excluded; $1 says why they are.",
        "requeue_excluding() {",
        '  excluded=$(excluded_now | paste -sd, -)',
        '  excluded="${excluded}${excluded:+,}$sick"',
        '  echo "job $SLURM_JOB_ID: excluding $sick ($1); ExcNodeList=$excluded"',
        "  # A running job's ExcNodeList cannot change: requeue it held (SLURM then sends this script SIGTERM, which",
        "  # the trap survives, and SIGKILL after KillWait), change it once the job has left RUNNING (read back: under",
        "  # load slurmctld refuses updates for a while after the requeue), release it.",
        '  scontrol requeuehold "$SLURM_JOB_ID"',
        f"  give_up=$((SECONDS + {EXCLUDE_WITHIN_S}))",
        '  until { scontrol update JobId="$SLURM_JOB_ID" ExcNodeList="$excluded" 2>/dev/null && all_excluded; }; do',
        '    [ "$SECONDS" -lt "$give_up" ] || break',
        "    sleep 1",
        "  done",
        '  scontrol release "$SLURM_JOB_ID"',
        '  if all_excluded; then',
        '    echo "job $SLURM_JOB_ID: released with ExcNodeList=$(excluded_now | paste -sd, -): it waits for other '
        'nodes"',
        "  else",
        f'    echo "job $SLURM_JOB_ID: SLURM refused ExcNodeList=$excluded for {EXCLUDE_WITHIN_S} s; released '
        'without it: the job may meet $sick again (drain it: scontrol update NodeName=$sick State=DRAIN '
        'Reason=node_check)"',
        "  fi",
        "}",
        "# Hosts of this job the straggler check marked slow (logging.straggler.action=exclude), comma-separated.",
        "marked_hosts() {",
        f'  [ -s "$run_dir/{SLOW_HOSTS_FILE}" ] || return 0',
        '  for host in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
        f'    grep -qx "$host" "$run_dir/{SLOW_HOSTS_FILE}" && printf "%s\\n" "$host"',
        "  done | paste -sd, -",
        "}",
        "# A field of a record (status.json and refused.json hold one '\"key\": value' line each), quotes removed.",
        "field() {",
        r'  sed -n "s/^ *\"$2\": *\"\{0,1\}\([^\",]*\).*/\1/p" "$1" 2>/dev/null | head -n 1',
        "}",
        "# Only this launch's records count: another launch refused beside this run wrote its own.",
        f'launch_id="${LAUNCH_ID_VARIABLE}"',
        'state=',
        '[ "$(field "$run_dir/status.json" launch)" = "$launch_id" ] && state=$(field "$run_dir/status.json" state)',
        f'[ "$(field "$run_dir/{REFUSED_FILE}" launch)" = "$launch_id" ] && state={REFUSED}  # refused: not the run',
        'echo "job $SLURM_JOB_ID: training ended with state ${state:-unknown} (srun exit $code)"',
        'case "$state" in',
        f"  {STATES[FINISHED]}) exit 0 ;;",
        f"  {STATES[REQUEUE]})",
        "    sick=$(marked_hosts)",
        '    if [ -n "$sick" ]; then requeue_excluding "marked slow by the straggler check"; exit 0; fi',
        '    echo "job $SLURM_JOB_ID: requeueing"; scontrol requeue "$SLURM_JOB_ID"; exit 0 ;;',
        f"  {STATES[PERMANENT]}) exit {PERMANENT} ;;",
        f'  {STATES[STORAGE_FULL]}) echo "job $SLURM_JOB_ID: the checkpoint file system is full, not requeued: free '
        'space, then resubmit (see $run_dir/status.json)"; exit ' + f"{STORAGE_FULL} ;;",
        f'  {REFUSED}) echo "job $SLURM_JOB_ID: launch refused, not requeued: see $run_dir/{REFUSED_FILE}"; '
        f"exit {PERMANENT} ;;",
        f"  {STATES[INTERRUPTED]}) exit {INTERRUPTED} ;;",
        "esac",
        "# Hung, crashed, or no status: a node may be sick. Ask each one, exclude those that fail, requeue.",
        'failures="$run_dir/slurm-$SLURM_JOB_ID.failures"',
        'requeues=$(cat "$failures" 2>/dev/null | wc -l)',
        f'if [ "$requeues" -ge {launch.max_requeues} ]; then',
        f'  echo "job $SLURM_JOB_ID: not requeued: {launch.max_requeues} requeues after failed runs already '
        '(launch.max_requeues; see $failures); left to a person"',
        '  exit "$code"',
        "fi",
        'checks="$run_dir/node_check/$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"',
        'rm -rf "$checks"; mkdir -p "$checks"',
        f"timeout {NODE_CHECK_TIMEOUT_S} srun --label --ntasks-per-node=1 --kill-on-bad-exit=0 {container}"
        f'bash -c {on_node} node_check "$checks"',
        "sick=; nodes=0; failing=0",
        'for host in $(scontrol show hostnames "$SLURM_JOB_NODELIST"); do',
        "  nodes=$((nodes + 1))",
        '  [ -e "$checks/$host" ] || { sick="$sick${sick:+,}$host"; failing=$((failing + 1)); }',
        "done",
        "# Every node of several failing is a shared cause (the file system, the fabric), not sick machines: excluding",
        "# them all would leave the job nowhere to run.",
        'if [ "$nodes" -gt 1 ] && [ "$failing" -eq "$nodes" ]; then',
        '  echo "job $SLURM_JOB_ID: all $nodes nodes failed the node check: a shared cause, no node excluded"',
        "  sick=",
        "fi",
        "# The hosts the straggler check marked go too (they passed the check: slow, not broken).",
        'marked=$(marked_hosts); why="failed the node check or did not answer"',
        'for host in ${marked//,/ }; do',
        '  case ",$sick," in *",$host,"*) ;; *) sick="$sick${sick:+,}$host"; why="$why, or marked slow" ;; esac',
        "done",
        'echo "restart ${SLURM_RESTART_COUNT:-0}: state ${state:-unknown}, srun exit $code, excluded: ${sick:-none}" '
        '>> "$failures"',
        f'echo "job $SLURM_JOB_ID: requeueing after a failed run ($((requeues + 1)) of launch.max_requeues='
        f'{launch.max_requeues})"',
        'if [ -z "$sick" ]; then',
        '  [ "$failing" -gt 0 ] || echo "job $SLURM_JOB_ID: every node passed the node check"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'requeue_excluding "$why"',
        "exit 0",
    ]
