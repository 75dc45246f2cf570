"""python -m checkpoints_tool run in the test's own process, and a run's config as a file for its --config."""

import contextlib
import io
from dataclasses import dataclass
from pathlib import Path

import yaml

from moe_pretrain.config import config_to_dict


@dataclass
class Done:
    returncode: int
    stdout: str
    stderr: str


def tool(*args) -> Done:
    """python -m checkpoints_tool's main in this process (an interpreter start per command cost the suite
    about 10 s each); its exit code and what it printed. test_verify_exit_codes_name_bad_files runs the
    module itself once, for the process's exit code."""
    from checkpoints_tool.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return Done(code, out.getvalue(), err.getvalue())


def config_file_of(cfg, tmp_path: Path) -> Path:
    """The run's config as a file, for the tool's --config."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    return path
