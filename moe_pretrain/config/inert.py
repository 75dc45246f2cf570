"""Settings that act only together with another: a config that asks for one while the other is off is refused
at start, naming both, rather than running without what was asked for (eval.every=2 with evaluation off ran
no evaluation and said nothing).

A setting counts as asked for when it differs from its default in the direction that requests something
(a boolean that defaults to on and is turned off asks for nothing, so it is never refused).
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from moe_pretrain.config.errors import ConfigError
from moe_pretrain.config.stage import resolve_stages

if TYPE_CHECKING:
    from moe_pretrain.config.run import Config


@dataclass(frozen=True)
class Dependent:
    """Keys of a section (its dotted path) that act only when `active(config)` holds; `how` says why not."""

    section: str
    keys: tuple[str, ...]
    active: Callable[["Config"], bool]
    how: str


DEPENDENTS = (
    Dependent("eval", ("every", "blend", "holdout", "long_documents", "position_base", "probe_samples"),
              lambda c: c.eval.enabled,
              "evaluation is off (eval.tokens=0): set eval.tokens, the held-out tokens per dataset per evaluation "
              "(e.g. eval.tokens=65536)"),
    Dependent("model.mla", ("rope_theta",), lambda c: c.model.mla.position == "rope",
              "MLA rotates nothing with model.mla.position=nope (set model.mla.position=rope)"),
    Dependent("model.kda", ("lower_bound",), lambda c: c.model.kda.gate == "lower_bound",
              "the decay has no floor with model.kda.gate=softplus"),
    Dependent("precision", ("fp8_amax_history",), lambda c: c.precision.fp8 == "delayed",
              "only precision.fp8=delayed keeps amax histories"),
    Dependent("kernels", ("fp8_gemm",), lambda c: c.precision.fp8 != "off",
              "it is the engine of the FP8 expert GEMMs (set precision.fp8)"),
    Dependent("model.moe", ("qb_rate",), lambda c: c.model.moe.balancing == "qb",
              "it is quantile balancing's rate (model.moe.balancing=qb)"),
    Dependent("model.moe", ("qb_quantile",), lambda c: c.model.moe.balancing == "qb",
              "it chooses how quantile balancing finds its quantiles (model.moe.balancing=qb)"),
    Dependent("model.moe", ("qb_bins",), lambda c: c.model.moe.balancing == "qb" and c.model.moe.qb_quantile ==
              "histogram", "it sizes quantile balancing's histograms (model.moe.qb_quantile=histogram)"),
    Dependent("model.moe", ("aux_free_rate",), lambda c: c.model.moe.balancing == "aux_free",
              "it is the aux-free rule's rate (model.moe.balancing=aux_free)"),
    Dependent("model.moe", ("aux_loss_coef",), lambda c: c.model.moe.balancing == "aux_loss",
              "it weighs the auxiliary loss (model.moe.balancing=aux_loss)"),
    Dependent("parallel", ("ranks_per_node",),
              lambda c: c.parallel.expert_dispatch == "node" or c.logging.straggler.every > 0,
              "it cuts expert-parallel groups by node for parallel.expert_dispatch=node and names slow nodes for "
              "logging.straggler"),
    Dependent("parallel", ("vpp", "pipeline_schedule", "pipeline_layers"),
              lambda c: c.parallel.pp > 1, "there is no pipeline with parallel.pp=1"),
)


def _defaults(section: Any) -> dict[str, Any]:
    return {f.name: getattr(type(section)(), f.name) for f in fields(section)}


def check_inert_settings(config: "Config") -> None:
    """Raise ConfigError naming every setting that would do nothing, and what would make it act."""
    problems = []
    for dependent in DEPENDENTS:
        if dependent.active(config):
            continue
        section = functools.reduce(getattr, dependent.section.split("."), config)
        defaults = _defaults(section)
        for key in dependent.keys:
            value = getattr(section, key)
            if value != defaults[key]:
                problems.append(f"{dependent.section}.{key}={value} does nothing: {dependent.how}")
    if config.model.mla.position != "rope":
        for i, stage in enumerate(config.stages):
            if stage.rope_theta:
                problems.append(f"stages[{i}].rope_theta={stage.rope_theta} does nothing: MLA rotates nothing with "
                                "model.mla.position=nope (set model.mla.position=rope)")
    problems += _long_document_thresholds(config)
    problems += _context_parallel_methods(config)
    problems += _saved_input_policies(config)
    problems += _exchanges_kept(config)
    if problems:
        raise ConfigError("; ".join(problems))


def _long_document_thresholds(config: "Config") -> list[str]:
    """long_doc_tokens says which documents count as long; it acts only where some long_doc_share draws
    from them (data's, or the stage's own)."""
    how = "no long_doc_share draws from long documents (set data.long_doc_share or the stage's)"
    data, problems = config.data, []
    shares = [data.long_doc_share, *(s.long_doc_share for s in config.stages)]
    if data.long_doc_tokens and all(share is None for share in shares):
        problems.append(f"data.long_doc_tokens={data.long_doc_tokens} does nothing: {how}")
    for i, stage in enumerate(config.stages):
        if stage.long_doc_tokens and stage.long_doc_share is None and data.long_doc_share is None:
            problems.append(f"stages[{i}].long_doc_tokens={stage.long_doc_tokens} does nothing: {how}")
    return problems



def _context_parallel_methods(config: "Config") -> list[str]:
    """cp_mla chooses how MLA attends across context-parallel ranks: it acts only where cp > 1."""
    p, problems = config.parallel, []
    how = "MLA exchanges nothing without context parallelism"
    settings = resolve_stages(config)
    if p.cp_mla != "auto" and max(s.cp for s in settings) == 1:
        problems.append(f"parallel.cp_mla={p.cp_mla} does nothing: {how} (parallel.cp=1 and no stage sets cp > 1)")
    for i, (stage, resolved) in enumerate(zip(config.stages, settings)):
        if stage.cp_mla and resolved.cp == 1:
            problems.append(f"stages[{i}].cp_mla={stage.cp_mla} does nothing: {how} in this stage (its cp is 1)")
    return problems


def _exchanges_kept(config: "Config") -> list[str]:
    """recompute_exchanges=false keeps what full recomputation would fetch again over expert parallelism: it
    acts only where full recomputation runs with ep > 1."""
    modes = [s.recompute for s in resolve_stages(config)]
    if config.train.recompute_exchanges or ("full" in modes and config.parallel.ep > 1):
        return []
    return ["train.recompute_exchanges=false does nothing: only full recomputation (train.recompute=full or a "
            "stage's) with parallel.ep > 1 repeats the expert exchanges"]


def _saved_input_policies(config: "Config") -> list[str]:
    """saved_inputs moves what full recomputation keeps (each layer's inputs): it acts only where the
    recomputation in force is full."""
    train, problems = config.train, []
    how = "only train.recompute=full keeps just the layers' inputs (set recompute=full"
    settings = resolve_stages(config)
    if train.saved_inputs != "device" and "full" not in [s.recompute for s in settings]:
        problems.append(f"train.saved_inputs={train.saved_inputs} does nothing: {how})")
    for i, (stage, resolved) in enumerate(zip(config.stages, settings)):
        if stage.saved_inputs and resolved.recompute != "full":
            problems.append(f"stages[{i}].saved_inputs={stage.saved_inputs} does nothing: {how} in this stage)")
    return problems
