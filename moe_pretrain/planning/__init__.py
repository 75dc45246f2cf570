"""Sizing and memory of a run, before it runs and while it runs; one module per question:

- sizing.py: `python -m moe_pretrain.planning.sizing CONFIG`, the model's parameters and FLOPs (total, active per
  token: moe_pretrain/model/counts.py), and a pipeline stage's FLOPs under a stage's recomputation.
- rank_state.py: what a rank holds of parameters, gradients and optimizer moments under a layout (exact, from
  the sharding plan and the meta model).
- step_activations.py: what a training step saves for backward, per token and per layer.
- stage_memory.py: what a pipeline rank needs in each stage of a staged run (the two above, plus in-flight
  micro-batches and communication buffers), and the search for layouts that fit (`launch.plan`).
- measured.py: what this process measures (live tensor bytes for tests; allocator and resident figures for
  the benches).
"""
