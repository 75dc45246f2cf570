"""Our top-level package names are ours alone. An installed distribution that ships a top-level package of
the same name is shadowed by ours (or shadows it), and libraries that probe for it by import name break:
transformers 5.25 requires Hugging Face's `kernels` and imported our former `kernels/` package in its place."""

import importlib.metadata
import tomllib
from pathlib import Path

from moe_pretrain.log import PACKAGES

ROOT = Path(__file__).resolve().parents[2]


def test_the_listed_packages_are_the_ones_pyproject_installs():
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert sorted(name.rstrip("*") for name in include) == sorted(PACKAGES)
    assert all((ROOT / name / "__init__.py").is_file() for name in PACKAGES)


def test_no_installed_distribution_ships_a_package_named_like_ours():
    owners = importlib.metadata.packages_distributions()
    clashes = {name: owners[name] for name in PACKAGES if set(owners.get(name, [])) - {"moe-pretrain", "moe_pretrain"}}
    assert not clashes, f"top-level package names also shipped by other installed distributions: {clashes}"
