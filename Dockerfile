# GPU image, first version. The NGC PyTorch base brings CUDA torch, NCCL, Transformer Engine and
# NVIDIA apex; we add megatron-core and fla (KDA Triton kernels) and install this package without
# letting pip touch the base image's torch. Not yet built or run by this project (no GPU machine).
FROM nvcr.io/nvidia/pytorch:25.09-py3

WORKDIR /workspace/moe-pretrain
COPY pyproject.toml README.md ./
COPY moe_pretrain ./moe_pretrain
COPY parallel ./parallel
COPY kernels ./kernels
COPY launch ./launch
COPY checkpoints_tool ./checkpoints_tool
COPY configs ./configs

RUN pip install --no-cache-dir "megatron-core>=0.16,<0.17" "pyyaml>=6" fla-core \
 && pip install --no-cache-dir --no-deps -e .

ENTRYPOINT ["python", "-m", "launch.train"]
CMD ["--config", "configs/smoke.yaml"]
