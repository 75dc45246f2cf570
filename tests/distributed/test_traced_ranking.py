"""launch.plan --propose --trace (planning/traced_ranking.py): the layouts it plays are the plan's fastest and the
configured one, each played as the config layer it writes out says, and they are ranked by the traced step (the
estimate from the GPU's calibration table, the bound beside it).

The smoke schedule (configs/stages/tiny.yaml) on 8 GPUs of 0.2 GB, as tests/unit/test_fastest_layouts.py. The
winner's config layer is then layered over the same files by hand and its stage played by launch.dryrun on its
own: the same counts, and the same whole step from them, as the ranking printed. The configured layout of these
files does not pass the start-up checks at 8 GPUs, and the ranking says why in one line.
"""

import json
import subprocess
import sys

import pytest
import yaml

from moe_pretrain.config import load_config
from moe_pretrain.config.stage import resolve_stages
from moe_pretrain.gpus import GPUS
from moe_pretrain.planning.fastest_layouts import fastest_layouts
from moe_pretrain.planning.plan_step_time import traced_stage_step
from moe_pretrain.planning.stage_memory import MemoryPlanner, RunLayout

FILES = ["--config", "configs/smoke.yaml", "--config", "configs/stages/tiny.yaml"]
SAME = ("step_s", "compute_s", "flops", "launches", "peak_bytes", "collectives", "exposed_s")
"""What a trace counts (its wall time here aside)."""


@pytest.mark.timeout(300)
def test_the_traced_ranking_plays_the_plans_fastest_as_their_config_layers_say(tmp_path):
    ranking = tmp_path / "ranking.json"
    result = subprocess.run([sys.executable, "-m", "launch.plan", *FILES, "--gpus", "8", "--gpu-gb", "0.2",
                             "--propose", "--trace", "1", "--dispatch-chunks", "1,2", "--trace-json", str(ranking)],
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr[-2000:]
    traced = json.loads(ranking.read_text())

    cfg = load_config(["configs/smoke.yaml", "configs/stages/tiny.yaml"])
    fastest = fastest_layouts(MemoryPlanner(cfg), 8, 0.2e9, GPUS["h200"])[0].run.describe()
    assert {(t["source"], t["layout"].split(" cp=")[0]) for t in traced} == {("plan #1", fastest)}
    assert sorted(t["layout"].rsplit(" ", 1)[1] for t in traced) == ["chunks=1", "chunks=2"]
    assert [(not t["fits"], t["step_s"]) for t in traced] == sorted((not t["fits"], t["step_s"]) for t in traced)
    configured = [line for line in result.stdout.splitlines() if "refused by the start-up checks" in line]
    assert len(configured) == 2 and all("stages[1]" in line and "micro_batches" in line for line in configured)

    winner = traced[0]
    layer = tmp_path / "winner.yaml"
    layer.write_text(yaml.safe_dump(winner["config"]))
    again = tmp_path / "again.json"
    rank = winner["traces"][0]["rank"]
    subprocess.run([sys.executable, "-m", "launch.dryrun", *FILES, "--config", str(layer), "--gpus", "8",
                    "--stage", winner["stage"], "--micro-batches", str(winner["cut_micro_batches"]),
                    "--rank", str(rank), "--json", str(again)], check=True, timeout=200, capture_output=True)
    alone = json.loads(again.read_text())
    assert [{k: trace[k] for k in SAME} for trace in alone] == [{k: trace[k] for k in SAME}
                                                                for trace in winner["traces"]]

    chosen = load_config(["configs/smoke.yaml", "configs/stages/tiny.yaml", str(layer)])
    stage = [s.name for s in chosen.stages].index(winner["stage"])
    p = chosen.parallel
    run, played = RunLayout(8, p.tp, p.pp, p.ep, p.vpp), resolve_stages(chosen)[stage]
    step = traced_stage_step(chosen, run, played, alone, GPUS["h200"], "estimate")  # the ranking's: H200's table
    assert step.step_s == pytest.approx(winner["step_s"], rel=1e-12)
    assert step.mfu == pytest.approx(winner["mfu"], rel=1e-12)
    bound = traced_stage_step(chosen, run, played, alone, GPUS["h200"])
    assert bound.step_s == pytest.approx(winner["bound"]["step_s"], rel=1e-12) and bound.step_s < step.step_s


@pytest.mark.timeout(120)
def test_a_stage_or_chunk_count_it_cannot_trace_is_refused_in_one_line_before_the_search():
    for flag, value, named in (("--trace-stage", "ctx9", "--trace-stage ctx9"),
                               ("--dispatch-chunks", "2,0", "--dispatch-chunks 2,0")):
        result = subprocess.run([sys.executable, "-m", "launch.plan", *FILES, "--gpus", "8", "--propose", "--trace",
                                 "1", flag, value], capture_output=True, text=True, timeout=100)
        assert result.returncode == 78 and "memory per GPU" not in result.stdout
        assert result.stderr.strip().count("\n") == 0 and named in result.stderr
