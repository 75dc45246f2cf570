"""What train.recompute (and a stage's recompute) may name: none, selective, full, or a comma-separated list of
modules (model/recompute.py says what each recomputes)."""

RECOMPUTE_MODULES = ("attn_res", "norms", "kda_pre", "mla_up", "core", "experts", "expert_act")
"""What train.recompute may list, in the order of a layer's forward."""
SELECTIVE = frozenset({"core", "experts"})
"""What train.recompute=selective recomputes."""


def recompute_modules(mode: str) -> frozenset[str]:
    """The modules a train.recompute value recomputes one region each (none for none and full); the value
    is checked at load (recompute_problem)."""
    if mode in ("none", "full", ""):
        return frozenset()
    if mode == "selective":
        return SELECTIVE
    return frozenset(name.strip() for name in mode.split(","))


def recompute_problem(mode: str) -> str | None:
    """Why a train.recompute value is not one (None: it is)."""
    if mode in ("none", "full", "selective"):
        return None
    unknown = [name for name in recompute_modules(mode) if name not in RECOMPUTE_MODULES]
    if not mode.strip() or unknown:
        return (f"{mode!r} must be none, selective, full or a comma-separated list of "
                f"{', '.join(RECOMPUTE_MODULES)}")
    return None
