"""launch.plan ends with one verdict line, and prints its numbers whole: a plan in which a stage
does not fit, or has no valid layout, says so on that stage's step line, in the total and in the verdict, which
names the smallest layout that fits as --propose finds it. The smoke schedule (configs/stages/tiny.yaml)."""

import pytest

from launch.plan import main
from moe_pretrain.planning.stage_memory import gigabytes

FILES = ["--config", "configs/smoke.yaml", "--config", "configs/stages/tiny.yaml"]


def plan_lines(capsys, *args: str) -> tuple[int, list[str]]:
    code = main([*FILES, *args])
    return code, capsys.readouterr().out.splitlines()


@pytest.mark.timeout(120)
def test_a_layout_that_fits_says_so(capsys):
    code, lines = plan_lines(capsys, "--gpus", "2")
    assert code == 0 and lines[-1].startswith("verdict: fits: every stage within 141 GB a GPU (the most, ")
    assert not any("does not fit" in line for line in lines)


@pytest.mark.timeout(120)
def test_stages_without_a_valid_layout_are_named_with_the_smallest_layout_that_fits(capsys):
    code, lines = plan_lines(capsys, "--gpus", "8", "--gpu-gb", "0.2")
    assert code == 1
    assert lines[-1] == ("verdict: does not fit: ctx512 has no valid layout; ctx1024 has no valid layout; the "
                         "smallest that fits with 10% headroom is tp=1 pp=1 ep=8 with ctx128 cp=1 none M=2, ctx512 "
                         "cp=2 none M=1, ctx1024 cp=4 latent none M=1 (--propose)")
    assert lines[-2].endswith("(plan), though 2 of 3 stages do not fit or have no valid layout")


@pytest.mark.timeout(120)
def test_stages_that_do_not_fit_say_so_on_their_lines(capsys):
    code, lines = plan_lines(capsys, "--gpus", "2", "--gpu-gb", "0.05")
    assert code == 1
    times = lines[next(i for i, line in enumerate(lines) if line.startswith("step time on ")) + 2:]
    steps = [line for line in times if line.split()[:1] in (["ctx128"], ["ctx512"], ["ctx1024"])]
    assert len(steps) == 3 and all(line.endswith("(does not fit)") for line in steps), steps
    assert lines[-1].startswith("verdict: does not fit: ctx128 needs ") and " GB of 0.05; ctx512 needs " in lines[-1]
    assert lines[-1].endswith("; no layout of 2 GPUs fits every stage with 10% headroom (--propose)")


def test_numbers_of_any_size_keep_their_digits():
    assert gigabytes(10_002.7e9, 6) == "10002.7" and gigabytes(2.5e9, 6) == "   2.5" and gigabytes(2.5e9) == "    2.5"
