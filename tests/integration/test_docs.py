"""The docs point at what exists: every relative link, every repository path and every `python -m` module that
README.md and docs/*.md name (a renamed file or module cannot leave a stale pointer), every command the
README's tour runs answers --help, and docs/layout.md lists every package and module of the code."""

import contextlib
import importlib.util
import io
import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TOP = ("moe_pretrain", "parallel", "launch", "tests", "bench", "configs", "gpu_kernels", "checkpoints_tool", "docs",
       ".ci")
"""Top-level directories a path in the docs may start with."""
PACKAGE = ("model", "planning", "training", "operations", "ops", "checkpoint", "fp8", "config")
"""moe_pretrain's sub-packages, which the docs also name without the moe_pretrain/ prefix (not data/: the docs'
example datasets live there)."""
PATH = re.compile(r"(?<![\w./<-])((?:\.ci|[a-z_]+)/[\w./-]*[\w/])")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
MODULE = re.compile(r"python -m ([\w.]+)")


def named_paths(text: str) -> set[str]:
    """Repository paths a page names (test ids' ::names dropped; placeholders such as runs/<run> skipped)."""
    found = set()
    for path in PATH.findall(text):
        first = path.split("/")[0]
        if first in TOP or first in PACKAGE:
            found.add(path.split("::")[0].rstrip("."))
    return found


def exists(path: str) -> bool:
    """A file or directory, from the root or moe_pretrain/; or module.attribute (planning/dry_run.traced_step)."""
    if "*" in path:
        return any(ROOT.glob(path)) or any((ROOT / "moe_pretrain").glob(path))
    module, _, attribute = path.rpartition(".")
    candidates = [path] + ([f"{module}.py"] if attribute.isidentifier() and attribute != "py" else [])
    return any((base / c).exists() for base in (ROOT, ROOT / "moe_pretrain") for c in candidates)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_link_path_and_module_a_page_names_exists(page):
    text = page.read_text()
    links = [link for link in LINK.findall(text) if "://" not in link and not link.startswith("mailto:")]
    assert [link for link in links if not (page.parent / link).exists()] == [], f"{page.name}: broken links"
    assert sorted(p for p in named_paths(text) if not exists(p)) == [], f"{page.name}: paths that do not exist"
    modules = set(MODULE.findall(text))
    assert sorted(m for m in modules if importlib.util.find_spec(m.split(".")[0]) is None
                  or importlib.util.find_spec(m) is None) == [], f"{page.name}: modules that do not exist"


@pytest.mark.timeout(300)
def test_every_command_of_the_readme_answers_help(monkeypatch):
    """Each command run as `python -m module --help` would run it, in this process (one interpreter start for
    all of them): argparse prints its usage and exits 0 before the command does anything."""
    modules = sorted(set(MODULE.findall((ROOT / "README.md").read_text())))
    assert modules
    monkeypatch.chdir(ROOT)
    for module in modules:
        monkeypatch.setattr(sys, "argv", [module, "--help"])
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        assert done.value.code in (0, None) and "usage" in out.getvalue().lower(), (module, out.getvalue()[-2000:])


CODE_ROOTS = ("moe_pretrain", "parallel", "gpu_kernels", "launch", "checkpoints_tool", "bench")
SECTION = re.compile(r"^## `([\w/]+)/`", re.M)


def test_the_layout_page_lists_every_package_and_module_and_only_those():
    listed: dict[str, set[str]] = {}
    for section in re.split(r"(?=^## `)", (ROOT / "docs" / "layout.md").read_text(), flags=re.M)[1:]:
        package = SECTION.match(section).group(1)
        listed[package] = set(re.findall(r"^\| `([\w.]+\.(?:py|sh))` \|", section, re.M))
    on_disk = {}
    for root in CODE_ROOTS:
        for folder in [ROOT / root, *(p.parent for p in (ROOT / root).rglob("__init__.py"))]:
            if "__pycache__" not in folder.parts:
                on_disk[str(folder.relative_to(ROOT))] = {f.name for f in folder.iterdir()
                                                          if f.suffix in (".py", ".sh") and f.name != "__init__.py"}
    assert sorted(set(on_disk) - set(listed)) == [], "packages docs/layout.md does not list"
    assert sorted(set(listed) - set(on_disk)) == [], "packages docs/layout.md lists that do not exist"
    for package, modules in on_disk.items():
        assert sorted(modules ^ listed[package]) == [], f"docs/layout.md's {package}/: modules missing or gone"
