# GPU image. The NGC PyTorch base brings CUDA torch, NCCL, Transformer Engine and NVIDIA apex; we add
# megatron-core, fla (KDA Triton kernels) and the optional extras, and install this package without
# letting pip touch the base image's torch. Not built or run by this project yet (no Docker engine and
# no GPU machine here); it is linted with hadolint in the tests (tests/integration/test_dockerfile.py).
#
#   docker build -t moe-pretrain:latest .
#   docker run --gpus all --ipc=host moe-pretrain:latest --config configs/smoke.yaml
#   (on SLURM: launch.python=/usr/bin/python inside the image, e.g. with pyxis/enroot --container-image)
# 25.12: torch 2.10 (pyproject's floor is 2.9), CUDA 13.1, Transformer Engine within megatron-core 0.16.1's range.
FROM nvcr.io/nvidia/pytorch:25.12-py3

# torchrun --numa-binding (launch.numa_binding: node, the default for GPU jobs) runs each worker under numactl and
# refuses to start without it. Not pinned: the base image's Ubuntu release decides the version.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends numactl \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace/moe-pretrain
COPY pyproject.toml README.md ./
COPY moe_pretrain ./moe_pretrain
COPY parallel ./parallel
COPY gpu_kernels ./gpu_kernels
COPY launch ./launch
COPY checkpoints_tool ./checkpoints_tool
COPY configs ./configs

RUN pip install --no-cache-dir "megatron-core==0.16.1" "pyyaml==6.0.4" "fla-core==0.6.0" \
        "tokenizers==0.23.3" "tiktoken==0.14.0" "tensorboard==2.21.0" "matplotlib==3.11.2" \
 && pip install --no-cache-dir --no-deps -e . \
 && useradd --create-home --uid 1000 trainer \
 && chown -R trainer /workspace/moe-pretrain

# Training needs no root; run directories and the data cache go under the user's home by default.
USER 1000
ENV MOE_PRETRAIN_CACHE=/home/trainer/.cache/moe-pretrain

# `python -m launch.train --config ...` (one process) or, under torchrun / launch.slurm, the same module.
ENTRYPOINT ["python", "-m", "launch.train"]
CMD ["--config", "configs/smoke.yaml"]
