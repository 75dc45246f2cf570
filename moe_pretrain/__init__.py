"""moe-pretrain: the model, config, data, checkpoints and training loop.

Two dependencies warn about situations that are expected here, at every start or save: megatron-core,
at import, that Transformer Engine and apex are absent (what is and is not accelerated is said once at
start-up instead: gpu_kernels/fast_paths.py); torch.distributed.checkpoint, at every save and load of a
single process, that it assumes one process, and (torch 2.10, the GPU image's) at every save, that its own
writer calls the deprecated Tensor.storage(). Every entry point imports this package before either, so
the filters set here run first.
"""

import warnings

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable or uninitialized, "
                        "assuming the intent is to (save|load) in a single process", category=UserWarning)
warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning,
                        module=r"torch\.distributed\.checkpoint\.")
