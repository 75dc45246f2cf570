"""Run configuration sections other than the model: parallel, data, train, optim, checkpoint, logging, launch
(precision and kernels live in config/precision.py)."""

from dataclasses import dataclass, field
from typing import Literal

from moe_pretrain.config.blend import BlendConfig, check_long_documents
from moe_pretrain.config.dry_run import DryRunConfig
from moe_pretrain.config.errors import require, require_positive
from moe_pretrain.config.evaluation import EvalConfig
from moe_pretrain.config.inert import check_inert_settings
from moe_pretrain.config.model import ModelConfig
from moe_pretrain.config.precision import KernelsConfig, PrecisionConfig
from moe_pretrain.config.recompute import recompute_problem
from moe_pretrain.config.stages import StageConfig, check_stages


@dataclass
class ParallelConfig:
    """Parallel layout; the data-parallel size is what the world size leaves: world / (tp * pp * cp)."""

    tp: int = 1
    """Tensor + sequence parallel size: attention heads, MLP columns and the vocabulary are split over tp
    ranks, and activations along T between blocks."""
    pp: int = 1
    """Pipeline stages (torch.distributed.pipelining; layers split by pipeline_layers or balanced)."""
    ep: int = 1
    """Expert-parallel size: experts are split over ep ranks, folded onto data-parallel ranks."""
    cp: int = 1
    """Context-parallel size: each sequence split over cp ranks (load-balanced fragments; stages may change it)."""
    expert_dispatch: Literal["flat", "node"] = "flat"
    """How the expert-parallel all-to-alls move tokens: flat (one row per routed copy, straight to its expert's
    rank) or node (once per node holding one of the token's experts, over the NIC, then fanned out inside the
    node; combine sums inside the node before crossing back: parallel/node_dispatch.py)."""
    dispatch_fp8: bool = False
    """Send the expert dispatch's rows as FP8 e4m3 in 1 x 128 blocks with fp32 scales (0.52x the bytes of bf16;
    the rail exchange under expert_dispatch=node), dequantized on arrival; gradients and combine stay in the
    run's dtype (parallel/fp8_dispatch.py). Off until a GPU has compared it with bf16 dispatch."""
    dispatch_chunks: int = 1
    """Split each MoE layer's tokens into this many chunks run as a pipeline: one chunk's all-to-alls in flight
    while another's experts compute, forward and backward (parallel/chunk_pipeline.py). 1: each exchange is
    waited for at once."""
    overlap_micro_batches: bool = False
    """Run one micro-batch's forward beside another's backward, each handing over to the other where it would
    wait for an exchange, so that its all-to-alls are in flight while the other computes (combined 1F1B;
    parallel/paired_passes.py): the step's forwards and backwards in pairs without pipeline parallelism, the
    1f1b schedule's steady state with it. Costs one micro-batch's saved activations more on each rank."""
    ranks_per_node: int = 0
    """Ranks sharing a node, for expert_dispatch=node and the straggler check's nodes: 0 = the launcher's
    (torchrun's LOCAL_WORLD_SIZE; the dry run's cluster.gpus_per_node). Set it to declare "nodes" of a few
    processes on one machine."""
    cp_mla: Literal["auto", "latent", "ulysses"] = "auto"
    """How MLA attends across cp ranks: latent (send each rank the per-token latent of the positions its
    queries see, expand keys block by block: any cp), ulysses (all-to-all trading heads for positions: needs
    the heads of a tensor-parallel rank divisible by cp); auto = ulysses where the heads allow it, else latent.
    Stages may set their own."""
    vpp: int = 1
    """Virtual pipeline stages per rank (interleaved_1f1b or zero_bubble schedules)."""
    pipeline_schedule: Literal["1f1b", "interleaved_1f1b", "zero_bubble", "gpipe"] = "1f1b"
    """torch.distributed.pipelining schedule; interleaved_1f1b and zero_bubble (interleaved zero bubble)
    run vpp > 1 virtual stages per rank."""
    pipeline_layers: list[int] = field(default_factory=list)
    """Layers per pipeline stage (pp x vpp entries, in stage order); empty = balanced automatically."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl on CUDA machines, gloo elsewhere. It also picks the device, for one process as for many:
    nccl -> CUDA (local rank's GPU), gloo -> CPU; so gloo forces a CPU run on a GPU machine."""
    bucket_mb: float = 25.0
    """Gradient reduce-scatter bucket size in MiB."""
    overlap_param_gather: bool = True
    """Let each step's parameter all-gathers run into the next forward, each layer waiting for its own
    parameters (parallel/optimizer.py); false: the optimizer step waits for them all."""
    timeout_s: float = 600.0
    """Process-group timeout: a collective waiting longer fails instead of hanging (gloo's default is
    30 minutes); keep it above the longest checkpoint save."""

    def __post_init__(self) -> None:
        require_positive("parallel", tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp, vpp=self.vpp,
                         bucket_mb=self.bucket_mb, timeout_s=self.timeout_s, dispatch_chunks=self.dispatch_chunks)
        require(self.ranks_per_node >= 0, f"parallel.ranks_per_node={self.ranks_per_node} must be >= 0 (0: the "
                "launcher's)")


@dataclass
class DataConfig:
    """Training data: a blend of indexed datasets, or (blend empty) the embedded default corpus,
    Python stdlib source text plus procedural captioned images, built into that format on first use."""

    seq_len: int = 256
    """Tokens per sequence (packed documents; a staged run takes each stage's seq_len)."""
    batch_size: int = 8
    """Global sequences per optimizer step (split over micro-batches and data-parallel ranks)."""
    micro_batches: int = 0
    """Gradient-accumulation steps per optimizer step; batch_size must divide by it. 0 = derived from the
    layout at start (logged at start-up): 1 without pipeline parallelism, else parallel.pp, the smallest
    count the pipeline schedules accept."""
    blend: list[BlendConfig] = field(default_factory=list)
    """Datasets and their shares of the training tokens; empty = the embedded default corpus. Megatron-LM's
    --data-path string ("0.3 /data/code 0.7 /data/web") is accepted too."""
    tokenizer: str = ""
    """The tokenizer of plain Megatron datasets in the blend (.bin / .idx without our .json): byte,
    hf:<tokenizer.json> or tiktoken:<file>; a blend entry's own tokenizer wins."""
    long_doc_share: float | None = None
    """Share of tokens drawn from long documents (see long_doc_tokens), in every dataset of the blend;
    None = the datasets' natural mixture. A stage may set its own. The embedded corpus then holds synthetic
    documents of that stage's sequence length in its text (its images stay short)."""
    long_doc_tokens: int = 0
    """Documents of at least this many tokens count as long; 0 = half the sequence length in force."""
    cache_dir: str = ""
    """Where the embedded corpus is built and cached; empty = $MOE_PRETRAIN_CACHE, else ~/.cache/moe-pretrain."""
    image_fraction: float = 0.1
    """Embedded corpus: share of tokens from captioned-image documents (the rest is stdlib text)."""
    text_doc_bytes: int = 2048
    """Embedded corpus: stdlib files are cut (at line breaks) into documents of at most this many bytes,
    so the text / image mix is even at the scale of one batch rather than one file."""
    embedded_images: int = 8192
    """Embedded corpus: how many synthetic captioned images are rendered (then revisited every epoch)."""
    image_size: int = 56
    """Embedded corpus: the longer side of the generated images, in pixels. Each image is S x S, S x S/2,
    S/2 x S or S/2 x S/2 (S = image_size; drawn per image), so batches mix sizes and aspect ratios; a multiple
    of 2 x model.vision.patch_size x model.vision.encoder.merge (56 for the model class)."""
    max_image_pixels: int | None = None
    """Largest image trained on, in pixels: larger stored images are shrunk to it (aspect ratio kept, sides
    multiples of patch_size x merge; moe_pretrain/data/image_size.py). None = the release's 3584 x 3584, or
    less where the shortest stage's rows are short: an image takes at most half a row."""
    seed: int = 1234
    """Document order (a fresh permutation of every dataset each epoch) and the synthetic images."""
    prefetch: bool = True
    """Prepare the next step's batches in a background thread while the current step computes (the
    metrics' data_wait_s is what a step still waits); false = prepare them inside the step."""

    def __post_init__(self) -> None:
        require_positive("data", seq_len=self.seq_len, batch_size=self.batch_size, image_size=self.image_size,
                         text_doc_bytes=self.text_doc_bytes, embedded_images=self.embedded_images)
        require(self.max_image_pixels is None or self.max_image_pixels > 0,
                f"data.max_image_pixels={self.max_image_pixels} must be > 0 (or null: the default)")
        require(self.micro_batches >= 0, f"data.micro_batches={self.micro_batches} must be >= 0 (0 = derived)")
        require(not self.micro_batches or self.batch_size % self.micro_batches == 0,
                f"data.batch_size={self.batch_size} must be divisible by data.micro_batches={self.micro_batches}")
        require(0.0 <= self.image_fraction <= 1.0, f"data.image_fraction={self.image_fraction} must be in [0, 1]")
        check_long_documents("data", self.long_doc_share, self.long_doc_tokens)
        for i, entry in enumerate(self.blend):
            entry.check(f"data.blend[{i}]")


@dataclass
class TrainConfig:
    steps: int = 100
    """Optimizer steps of the run (with stages: their sum)."""
    seed: int = 0
    """Seed of the parameters' initialisation (the data order has data.seed)."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Parameter and activation dtype; router and nonlinearities always run in >= fp32."""
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype the matmuls' weights are held in between steps (model/linear.py's cast_weights: every linear
    layer's but the routers', and the routed experts'). bfloat16 (megatron-core's bf16 parameters) holds them
    in bf16 and the optimizer keeps an fp32 master of its ZeRO-1 slice (parallel/optimizer.py): the forward
    reads the same bf16 values autocast would have cast, the state holds half the bytes and no step copy.
    Needs train.dtype=bfloat16."""
    grad_dtype: Literal["float32", "bfloat16"] = "float32"
    """The dtype those weights' gradients accumulate over the micro-batches and reduce in (megatron-core's
    main_grads_dtype). bfloat16 halves the gradient buffers and rounds every accumulation (lossy: the sum of
    M micro-batches' gradients to bf16's 8 bits at each add). Needs train.param_dtype=bfloat16."""
    run_dir: str = "runs/smoke"
    """Where the run writes its metrics, logs and (checkpoint.dir empty) checkpoints."""
    resume: str = "auto"
    """auto: continue from the newest verified checkpoint in checkpoint.dir, if any; none: start fresh;
    or the path of one checkpoint directory (fails clearly if it does not verify)."""
    exit_at_step: int = 0
    """Save and exit cleanly after this step (as if the job had been stopped there); 0 = run to the end."""
    max_skipped_steps: int = 3
    """A step whose loss or gradient norm is not finite is skipped (no update) and counted; this many in
    a row stop the run with the step and the last good checkpoint named."""
    hang_multiple: float = 10.0
    """Watchdog: a step running longer than this many times the median of the stage's recent steps (and
    at least hang_min_s) dumps every thread's stack to <run_dir>/hang/ and exits (code 76); 0 = off."""
    hang_min_s: float = 120.0
    """Watchdog: the multiple-of-median limit is never below this many seconds."""
    hang_timeout_s: float = 3600.0
    """Watchdog: the absolute limit for one step (also before any median exists); 0 = none."""
    recompute: str = "none"
    """Activation recomputation in backward (model/recompute.py): full re-runs every decoder layer, and every vision
    tower block, from its inputs; or a comma-separated list of the modules recomputed one region each: attn_res,
    norms, kda_pre, mla_up, core, experts, expert_act (selective = core,experts; launch.plan prices each set)."""
    saved_inputs: Literal["device", "host", "fp8"] = "device"
    """Where full recomputation keeps each layer's inputs until its backward (model/saved_inputs.py):
    device; host (copied out as saved, back one layer ahead of the backward; exact); fp8 (block-scaled
    e4m3 on the device: about half the bytes of bf16, lossy). Needs recompute=full."""
    recompute_exchanges: bool = True
    """Whether full recomputation's re-forward repeats the MoE layers' expert exchanges. false: each MoE layer
    is recomputed in pieces around its dispatch and combine (model/decoder_layer.py), which run once and keep
    what they received until the backward: the step sends the expert rows twice, not three times, for the
    stash priced by launch.plan. Needs recompute=full and ep > 1."""

    def __post_init__(self) -> None:
        require_positive("train", steps=self.steps)
        require(self.hang_multiple >= 0 and self.hang_min_s >= 0 and self.hang_timeout_s >= 0,
                "train.hang_multiple, train.hang_min_s and train.hang_timeout_s must be >= 0")
        require(self.max_skipped_steps >= 1, f"train.max_skipped_steps={self.max_skipped_steps} must be >= 1")
        require(self.param_dtype == "float32" or self.dtype == "bfloat16",
                f"train.param_dtype={self.param_dtype} needs train.dtype=bfloat16, not {self.dtype}")
        require(self.grad_dtype == "float32" or self.param_dtype == "bfloat16",
                f"train.grad_dtype={self.grad_dtype} needs train.param_dtype=bfloat16, not {self.param_dtype}")
        problem = recompute_problem(self.recompute)
        require(problem is None, f"train.recompute={problem}")
        require(0 <= self.exit_at_step <= self.steps,
                f"train.exit_at_step={self.exit_at_step} must be in [0, train.steps={self.steps}]")


@dataclass
class OptimConfig:
    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW for every parameter. muon: Per-Head Muon for the blocks' matrices (Q / K / V per head,
    experts per expert; training/muon_params.py), AdamW (beta1, beta2, eps) for embeddings, head, vectors and
    the rest; both take lr, the schedule and weight_decay (Muon's update is scaled to AdamW's RMS, Moonlight's
    0.2 sqrt(max(rows, columns)))."""
    muon_momentum: float = 0.95
    """Muon's Nesterov momentum."""
    qk_clip_threshold: float = 0.0
    """QK-clip (model/qk_clip.py; Kimi K2 used 100): after each step, every MLA head whose largest attention logit
    of the step exceeded this has its query and key weights scaled so it would not. 0 = off (no recording)."""
    lr: float = 3e-3
    """Peak learning rate (a staged run takes each stage's lr_peak)."""
    min_lr: float = 3e-4
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW's and Muon's)."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    eps: float = 1e-8
    """AdamW's eps."""
    warmup_steps: int = 10
    """Linear warmup from 0 to lr over the first steps (unstaged runs)."""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """cosine: warmup then cosine to min_lr; wsd: warmup, stable at lr, then linear decay to min_lr."""
    decay_fraction: float = 0.2
    """wsd only: the share of steps spent decaying."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    vision_lr_scale: float = 1.0
    """The vision tower's and projector's learning rate as a multiple of the schedule's (both trained from
    scratch with the model). In tests/integration/test_multimodal.py's setting 0.1 is read sooner (0.94 held-out
accuracy at     200 steps against the full rate's 0.77); both reach 0.99 at 400."""
    vision_warmup_steps: int = 0
    """The tower's and projector's rate ramps from 0 to vision_lr_scale x the schedule's over this many
    optimizer steps, so the model first learns to read the tower's initial features, then the tower learns
    (tests/integration/test_multimodal.py's setting after a 200-step ramp: 0.99 at 300 steps, 0.95 without it). 0 = no
    ramp."""

    def __post_init__(self) -> None:
        require_positive("optim", lr=self.lr, vision_lr_scale=self.vision_lr_scale)
        require(0 <= self.muon_momentum < 1, f"optim.muon_momentum={self.muon_momentum} must be in [0, 1)")
        require(self.qk_clip_threshold >= 0, f"optim.qk_clip_threshold={self.qk_clip_threshold} must be >= 0 (0: off)")
        require(self.vision_warmup_steps >= 0, f"optim.vision_warmup_steps={self.vision_warmup_steps} must be >= 0")
        require(0 <= self.min_lr <= self.lr, f"optim.min_lr={self.min_lr} must be in [0, optim.lr={self.lr}]")
        require(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        require(0 < self.decay_fraction <= 1, f"optim.decay_fraction={self.decay_fraction} must be in (0, 1]")
        require(self.grad_clip >= 0, f"optim.grad_clip={self.grad_clip} must be >= 0")


@dataclass
class CheckpointConfig:
    """Sharded, reshardable checkpoints (moe_pretrain/checkpoint)."""

    dir: str = ""
    """Where step_<N>/ directories and `latest` live; empty = <train.run_dir>/checkpoints."""
    every: int = 0
    """Save every `every` steps; 0 = no step interval (see every_minutes)."""
    every_minutes: float = 30.0
    """Also save when this many minutes have passed since the last save (or the start), agreed by all
    ranks after a step; 0 = no time interval. Either way a run saves at its end and at train.exit_at_step."""
    keep_last: int = 2
    """Committed checkpoints kept (>= 2, so a damaged newest one always has a predecessor)."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this; 0 = none."""
    async_save: bool = False
    """Write checkpoints in the background: training stalls only while tensors are staged to host memory."""
    on_async_failure: Literal["stop", "continue"] = "stop"
    """When a background save fails (reported on every rank at the next step): stop with the error, or
    say so and keep training (the failed checkpoint is not committed either way)."""

    io_floor_mb_s: float = 100.0
    """The slowest storage rate per rank (MB/s) to plan for. Collectives that wait on checkpoint I/O (the
    commit's gather, resume verification) time out after parallel.timeout_s plus three passes over the
    largest rank's state at this rate, not after parallel.timeout_s alone."""

    def __post_init__(self) -> None:
        require(self.io_floor_mb_s > 0, f"checkpoint.io_floor_mb_s={self.io_floor_mb_s} must be > 0")
        require(self.every >= 0, f"checkpoint.every={self.every} must be >= 0")
        require(self.every_minutes >= 0, f"checkpoint.every_minutes={self.every_minutes} must be >= 0")
        require(self.keep_last >= 2, f"checkpoint.keep_last={self.keep_last} must be >= 2")
        require(self.keep_every >= 0, f"checkpoint.keep_every={self.keep_every} must be >= 0")


@dataclass
class WandbConfig:
    """Weights & Biases logging beside metrics.jsonl (rank 0); off while project is empty."""

    project: str = ""
    """The W&B project; empty = no W&B logging."""
    name: str = ""
    """The run's display name; empty = the run directory's name."""
    mode: Literal["online", "offline"] = "online"
    """offline writes <run_dir>/wandb for a later `wandb sync` (no network needed)."""


@dataclass
class StragglerConfig:
    """Slow ranks named (parallel/stragglers.py): each rank's compute against its pipeline stage's median."""

    every: int = 50
    """Steps per window: at its end one all-gather brings every rank's figures together; 0 = off."""
    threshold: float = 0.2
    """A rank is slow when its compute exceeds its stage's median by more than this fraction (and expert load
    is reported when its experts receive more than this over their group's mean)."""
    windows: int = 3
    """Slow windows in a row before a rank (or a host, all of its ranks) is named."""
    action: Literal["warn", "exclude"] = "warn"
    """warn: the log line, the record and the metrics. exclude: also the named hosts into <run_dir>/slow_hosts,
    which the SLURM job excludes as it next requeues (launch/slurm_outcome.py); the run is never stopped for it."""

    def __post_init__(self) -> None:
        require(self.every >= 0, f"logging.straggler.every={self.every} must be >= 0")
        require_positive("logging.straggler", threshold=self.threshold, windows=self.windows)


@dataclass
class LoggingConfig:
    log_every: int = 1
    """Print a progress line every log_every steps (metrics.jsonl gets every step)."""
    progress: bool = True
    """Print the progress lines (metrics.jsonl is written either way)."""
    peak_tflops: float = 0.0
    """Peak FLOP/s per process for MFU, in TFLOP/s; 0 = the vendor's dense BF16 peak on a GPU the table in
    training/peak_flops.py knows (bf16 runs; otherwise a start-up error asks for this key), a matmul timed
    once at start on CPU."""
    expert_load_every: int = 50
    """Record every expert's load per MoE layer at step 1, every this many steps and the last (for
    `python -m launch.report` heatmaps); 0 = never."""
    level: Literal["debug", "info", "warning", "error"] = "info"
    """Log level of the training processes; $MOE_PRETRAIN_LOG_LEVEL, when set, wins (moe_pretrain/log.py)."""
    all_ranks: bool = False
    """Informational lines from every rank, not only rank 0 (warnings and errors always come from every rank)."""
    tensorboard: bool = True
    """Also write the scalars as TensorBoard event files in <run_dir>/tensorboard when the `tensorboard`
    package is installed (`pip install 'moe-pretrain[tensorboard]'`)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)

    def __post_init__(self) -> None:
        require_positive("logging", log_every=self.log_every)
        require(self.expert_load_every >= 0, f"logging.expert_load_every={self.expert_load_every} must be >= 0")


@dataclass
class ClusterConfig:
    """The fabric a job runs on, per GPU (the dry run's step-time model: planning/step_time.py). Defaults: an
    H200 HGX node (public specifications): NVLink 4 at 900 GB/s both directions, one 400 Gb/s NIC a GPU."""

    gpus_per_node: int = 8
    """Consecutive ranks share a node (torchrun numbers a node's local ranks together)."""
    nvlink_gb_s: float = 450.0
    """GB/s one GPU sends to the others of its node (one direction)."""
    nic_gb_s: float = 50.0
    """GB/s one GPU sends to other nodes (its NIC, one direction)."""

    def __post_init__(self) -> None:
        require_positive("cluster", gpus_per_node=self.gpus_per_node, nvlink_gb_s=self.nvlink_gb_s,
                         nic_gb_s=self.nic_gb_s)


@dataclass
class LaunchConfig:
    """How `python -m launch.slurm` starts and keeps the job running (nodes, GPUs, time and partition are
    given on its command line, since they describe an allocation rather than the run)."""

    signal: str = "USR2"
    """Signal SLURM sends the job script signal_lead_s before the time limit (sbatch --signal=B:SIG@lead);
    the script forwards it to the training processes, which checkpoint and exit 75. USR2, because NCCL
    may use USR1."""
    signal_lead_s: int = 0
    """Seconds before the time limit at which the run stops to save: one step and a synchronous checkpoint.
    0 = derived at render time from the largest rank's checkpointed bytes at checkpoint.io_floor_mb_s
    (launch/signal_lead.py; 300 s at least). The training processes also stop by the clock at this lead
    (MOE_PRETRAIN_STOP_AT), should SLURM's signal come late or not at all."""
    max_restarts: int = 3
    """torchrun restarts of the workers after a crash, within one allocation (they resume automatically)."""
    max_requeues: int = 3
    """Requeues of the job after a run that ended hung, crashed or without a status (each after the node check
    has excluded the nodes that fail it); past this the job ends with the run's exit code, left to a person.
    Preemptions and time limits requeue without limit."""
    node_check: str = ""
    """The command srun runs once per node after such a run: a node where it fails or does not answer within
    NODE_CHECK_TIMEOUT_S is excluded from the requeued job (ExcNodeList). Empty = `<launch.python> -m
    launch.node_check` (GPUs present and computing, run_dir writable)."""
    numa_binding: Literal["off", "node", "socket", "exclusive", "core-complex"] = "node"
    """torchrun --numa-binding for GPU jobs (torch >= 2.9): each rank on the CPUs of its GPU's NUMA node. torch runs
    the workers under numactl and refuses to start without it: the Dockerfile installs it; `off` for an image
    without. Not used for CPU jobs (it binds by GPU)."""
    rdzv_port: int = 0
    """The c10d rendezvous port on the first node; 0 = 20000 + the job id modulo 20000, so that two jobs sharing a
    node (or a requeued job meeting its predecessor's lingering store) do not meet on one fixed port."""
    exclusive: bool = True
    """Whole nodes with all their memory (sbatch --exclusive --mem=0), as multi-node GPU training expects."""
    cpus_per_task: int = 0
    """CPUs per node for the training processes; 0 = 8 per GPU (or 1 per process on CPU)."""
    python: str = "python"
    """The interpreter on the compute nodes (e.g. /shared/venvs/moe/bin/python), or in the container."""
    container_image: str = ""
    """Run the training in this container through pyxis / enroot (e.g. nvcr.io#nvidia/pytorch:25.12-py3 or a
    .sqsh file): srun's --container-image and the flags below. Only the srun line: pyxis at the sbatch level
    would also wrap the script's own srun and scontrol. Empty: no container."""
    container_mounts: str = ""
    """srun --container-mounts (SRC:DST[,SRC:DST...]): the shared file system holding the code, run_dir and data."""
    container_workdir: str = ""
    """srun --container-workdir; empty = the job's working directory (its path must exist in the container)."""
    container_mount_home: bool = False
    """Mount the user's home in the container (pyxis does by default; off, --no-container-mount-home, keeps a
    home directory's Python packages and configuration out of the run)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the training processes, e.g. NCCL_IB_HCA: mlx5, NCCL_SOCKET_IFNAME: ib0."""

    def __post_init__(self) -> None:
        require(self.signal.isalnum() and self.signal.isupper(),
                f"launch.signal={self.signal!r} must be a signal name such as USR2 or TERM")
        require(0 <= self.rdzv_port < 65536,
                f"launch.rdzv_port={self.rdzv_port} must be a port, or 0 (derived from the job id)")
        require(self.signal_lead_s >= 0, f"launch.signal_lead_s={self.signal_lead_s} must be >= 0 (0: derived)")
        require(self.max_restarts >= 0 and self.cpus_per_task >= 0 and self.max_requeues >= 0,
                "launch.max_restarts, launch.max_requeues and launch.cpus_per_task must be >= 0")
        for name in self.env:
            require(name.isidentifier() and name.isascii(),
                    f"launch.env key {name!r} is not a valid environment variable name")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dry_run: DryRunConfig = field(default_factory=DryRunConfig)
    stages: list[StageConfig] = field(default_factory=list)
    """The staged context-extension schedule; empty = one stage from data.* and optim.* (train.steps)."""

    def __post_init__(self) -> None:
        check_stages(self.stages)
        check_inert_settings(self)
        if self.stages:
            total = sum(stage.steps for stage in self.stages)
            require(self.train.steps == total,
                    f"train.steps={self.train.steps} disagrees with the stages, which make {total} steps; "
                    f"set train.steps={total}")
            require(self.train.exit_at_step <= total, f"train.exit_at_step={self.train.exit_at_step} is past the "
                    f"schedule's {total} steps")
        load = self.dry_run.expert_load
        require(not load or len(load) == self.model.moe.num_experts,
                f"dry_run.expert_load has {len(load)} factors for model.moe.num_experts={self.model.moe.num_experts}")
        require(self.precision.fp8 == "off" or self.train.dtype != "float64",
                f"precision.fp8={self.precision.fp8} needs train.dtype float32 or bfloat16, not float64")
        vision = self.model.vision
        unit = 2 * vision.patch_size * vision.encoder.merge
        require(self.data.image_size % unit == 0,
                f"data.image_size={self.data.image_size} must be a multiple of 2 x model.vision.patch_size x "
                f"model.vision.encoder.merge = {unit} (its half is an image side too)")
        block = (vision.patch_size * vision.encoder.merge) ** 2
        require(self.data.max_image_pixels is None or self.data.max_image_pixels >= block,
                f"data.max_image_pixels={self.data.max_image_pixels} holds no block of model.vision.patch_size x "
                f"model.vision.encoder.merge = {block} pixels")
