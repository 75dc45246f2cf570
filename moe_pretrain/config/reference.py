"""The configuration reference (docs/config_reference.md), generated from the config dataclasses: every key with
its type, its default and the docstring written under its field, so the page cannot drift from the code
(tests/unit/test_config.py compares them).

Run: python -m moe_pretrain.config.reference > docs/config_reference.md
"""

import ast
import dataclasses
import inspect
import itertools
import textwrap
import typing
from collections.abc import Iterator

from moe_pretrain.config.run import Config

HEADER = """# Configuration reference

Every key, its type, its default (the dataclass's; `configs/smoke.yaml` and `configs/full.yaml` set their
own) and what it does. Generated from the field docstrings in `moe_pretrain/config/` by
`python -m moe_pretrain.config.reference > docs/config_reference.md`; a test fails when this page and the code
disagree. A key is set in a YAML config or on the command line as `section.key=value`; a stage's keys are
`stages[i].key` in the YAML's `stages` list. The page [configuration.md](configuration.md) says how configs are
loaded and checked.
"""


def field_docs(cls: type) -> dict[str, str]:
    """The string written under each field of a dataclass (attribute docstrings: Python keeps none at run
    time, so they are read from the class's source)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _type_name(annotation: object) -> str:
    if isinstance(annotation, str):
        return annotation
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(repr(choice) for choice in typing.get_args(annotation))
    if typing.get_origin(annotation) is not None:
        return str(annotation).replace("typing.", "").replace("|", "\\|")
    return getattr(annotation, "__name__", str(annotation))


def _element_dataclass(annotation: object) -> type | None:
    """The dataclass a list field holds (list[StageConfig] -> StageConfig), or None."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        return f"`{f.default_factory()!r}`"
    return "required"


def _rows(cls: type, prefix: str) -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, doc) of every leaf field under cls, depth first in definition order."""
    docs = field_docs(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, annotation = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(annotation):
            yield from _rows(annotation, f"{key}.")
            continue
        yield key, _type_name(annotation), _default(f), docs.get(f.name, "")
        if (element := _element_dataclass(annotation)) is not None:
            yield from _rows(element, f"{key}[i].")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def reference_markdown() -> str:
    """The whole page: one section per top-level key, a table row per key."""
    lines = [HEADER]
    hints = typing.get_type_hints(Config)
    for f in dataclasses.fields(Config):
        annotation = hints[f.name]
        section = annotation if dataclasses.is_dataclass(annotation) else _element_dataclass(annotation)
        lines += [f"## {f.name}", ""]
        if section.__doc__ and not section.__doc__.startswith(section.__name__ + "("):
            lines += [" ".join(section.__doc__.split()), ""]
        lines += ["| key | type | default | what it does |", "|---|---|---|---|"]
        prefix = f"{f.name}." if dataclasses.is_dataclass(annotation) else f"{f.name}[i]."
        lines += [f"| `{key}` | {kind} | {_cell(default)} | {_cell(doc)} |"
                  for key, kind, default, doc in _rows(section, prefix)]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference_markdown(), end="")
