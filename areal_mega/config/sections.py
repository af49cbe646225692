"""The sections of the experiment config whose rules are their fields' own ranges and choices:
cluster, model, optimizer, actor, reference model, dataplane, scheduler, data, evaluation,
checkpoints and the model's architecture numbers. Rules across sections are
:func:`areal_mega.config.experiment.validate`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from areal_mega.config.schema import _f

__all__ = [
    "ActorConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "DataSourceConfig",
    "DataImagesConfig",
    "DataplaneConfig",
    "EvalConfig",
    "ModelConfig",
    "ModelHParams",
    "OptimizerConfig",
    "RefConfig",
    "SchedulerConfig",
]


@dataclass
class ClusterConfig:
    n_nodes: int = _f(1, lo=1)
    n_gpus_per_node: int = _f(8, lo=1)
    device: str = _f(
        "auto", choices=["auto", "cpu", "cuda"], doc="auto: cuda when available, else cpu"
    )
    master_addr: str = "127.0.0.1"
    master_port: int = _f(0, lo=0, hi=65535, doc="0 picks a free port")
    dist_timeout_s: float = _f(600.0, lo=1.0)
    gpu_memory_gb: float = _f(
        80.0,
        lo=0.0,
        lo_open=True,
        doc="usable memory per GPU; --dry-run compares its estimate to it",
    )
    kill_grace_s: float = _f(10.0, lo=0.0, doc="SIGTERM -> SIGKILL grace when stopping processes")
    max_restarts: int = _f(3, lo=0, doc="trainer relaunches after a crash when recover=auto")
    server_ready_timeout_s: float = _f(
        600.0, lo=1.0, doc="how long launch.local waits for a rollout server"
    )
    server_base_port: int = _f(
        30000, lo=1024, hi=65535, doc="multi-node: rollout server k of a node listens on base + k"
    )
    cpu_threads_per_server: int = _f(
        1, lo=1, doc="cluster.device=cpu: torch threads of each local rollout server"
    )
    cpu_threads_per_trainer_rank: int = _f(
        0,
        lo=0,
        doc="cluster.device=cpu: threads of each trainer rank; 0 = the cores the servers leave",
    )


@dataclass
class ModelConfig:
    path: str = _f("", doc="HF-format model directory (config.json, tokenizer, safetensors)")
    dtype: str = _f("bf16", choices=["fp32", "bf16", "fp16"])
    make_vocab_size_divisible_by: int = _f(128, lo=1)
    recompute_granularity: Optional[str] = _f(None, choices=[None, "full", "selective"])
    attention_backend: str = _f(
        "auto",
        choices=["auto", "flash", "fused", "unfused", "local"],
        doc="auto: TransformerEngine picks its kernel on GPU, local attention on CPU; flash / "
        "fused / unfused: pin TE's kernel (GPU + TE); local: megatron's local spec "
        "with per-sequence torch SDPA on the packed batch (the only choice on GPU without "
        "TE; no CP)",
    )
    freeze_vision: bool = _f(
        False,
        doc="vision-language models (areal_mega/models/vlm): the vision tower (patch embedding "
        "and blocks) does not train; its projector and the language model do",
    )


@dataclass
class OptimizerConfig:
    lr: float = _f(1e-6, lo=0.0)
    min_lr: float = _f(0.0, lo=0.0)
    weight_decay: float = _f(0.0, lo=0.0)
    beta1: float = _f(0.9, lo=0.0, hi=1.0)
    beta2: float = _f(0.999, lo=0.0, hi=1.0)
    eps: float = _f(1e-8, lo=0.0, lo_open=True)
    clip_grad: float = _f(1.0, lo=0.0)
    warmup_steps: int = _f(0, lo=0)
    lr_schedule: str = _f("constant", choices=["constant", "cosine", "linear"])
    lr_decay_steps: int = _f(
        0,
        lo=0,
        doc="steps of the warmup+decay schedule; 0 = the "
        "trainer's total steps (or warmup_steps + 1 when unknown)",
    )
    use_distributed_optimizer: bool = True


@dataclass
class ActorConfig:
    temperature: float = _f(
        1.0, lo=0.0, lo_open=True, doc="sampling temperature; logprobs are recomputed at it"
    )
    ppo_n_minibatches: int = _f(1, lo=1)
    prox_logprobs: str = _f(
        "auto",
        choices=["auto", "recompute"],
        doc="π_prox of the decoupled loss: auto = taken from the training "
        "forward (detached) when the step is one optimizer step on the "
        "weights that define π_prox and nothing reads it before training; "
        "recompute = always a forward pass of its own (AReaL)",
    )
    share_prompt_prefix: bool = _f(
        True,
        doc="samples of a micro-batch with the same prompt "
        "compute it once (same results; local attention, no CP/SP)",
    )
    sequence_parallel: bool = False
    virtual_pipeline_size: Optional[int] = _f(None, lo=1)
    logprob_chunk_size: Optional[int] = _f(None, lo=1)
    max_consecutive_skips: int = _f(
        3,
        lo=1,
        doc="training steps in a row whose loss or "
        "gradients are non-finite (each skipped: no update "
        "applied) before the run stops, naming the likely source",
    )


@dataclass
class RefConfig:
    enabled: bool = _f(False, doc="build a reference model (needed when algorithm.kl_coef > 0)")
    path: str = _f("", doc="defaults to model.path")


@dataclass
class DataplaneConfig:
    endpoint: str = _f("", doc="zmq endpoint; empty = ipc in the run directory")
    control_endpoint: str = _f("", doc="rollout-worker control socket; empty = ipc in run dir")
    secret: Optional[str] = None
    max_queue: int = _f(1024, lo=1, doc="trajectories buffered before senders block")
    max_message_bytes: int = _f(1 << 30, lo=1024)
    sender_window: int = _f(
        64, lo=1, doc="unacknowledged trajectories per sender before send blocks (backpressure)"
    )
    allow_remote: bool = _f(False, doc="let the receiver bind a non-loopback interface")


@dataclass
class SchedulerConfig:
    max_tokens_per_mb: int = _f(8192, lo=1)
    balance_by: str = _f("tokens", choices=["tokens", "flops"])
    flops_linear_coef: float = _f(49152.0, lo=0.0, doc="a in cost a*L + L^2 (~12 x hidden)")
    min_micro_batches: int = _f(1, lo=1)


@dataclass
class DataSourceConfig:
    """One task of a multi-task run (``data.sources``): prompts drawn with probability
    proportional to ``weight``, scored by ``reward_fn``, logged as ``reward/<name>``."""

    name: str = _f("", doc="metric name: reward/<name>; unique")
    path: str = _f(
        "",
        doc="JSONL / parquet file, a saved HF dataset directory, or hf:owner/name[:config][@split]",
    )
    weight: float = _f(1.0, lo=0.0, lo_open=True)
    reward_fn: str = _f("", doc="'package.module:function'; empty = rollout.reward_fn")
    reward_kwargs: dict = _f(factory=dict, doc="extra keyword arguments of reward_fn")
    fields: dict = _f(factory=dict, doc="{prompt: <field>, answer: <field>}; empty = data.fields")


@dataclass
class DataImagesConfig:
    """Images in prompt records (``data.images``; record formats: :mod:`areal_mega.data.images`).
    Each image is resized, aspect kept, to sides that are multiples of the model's patch x
    merge size with an area in [``min_pixels``, ``max_pixels``] before the model's image
    processor sees it; the rollout server is sent that resized image, so both compute the same
    patches."""

    min_pixels: int = _f(0, lo=0, doc="smallest image area in pixels; 0 = the processor's own")
    max_pixels: int = _f(0, lo=0, doc="largest image area in pixels; 0 = the processor's own")
    max_source_pixels: int = _f(
        64 * 1024 * 1024, lo=1, doc="an image file with more pixels is a bad image"
    )
    max_images: int = _f(16, lo=1, doc="a prompt with more images is a bad record")
    on_bad: str = _f(
        "error",
        choices=["error", "skip"],
        doc="a bad image (missing, undecodable, too large): stop naming the record, or skip "
        "the record and count it",
    )
    images_key: str = _f(
        "images", doc="record field of the images of a prompt with <image> markers"
    )


@dataclass
class DataConfig:
    train_path: str = _f(
        "",
        doc="one source (shorthand for a single entry of data.sources): "
        "a file, a saved HF dataset directory or hf:owner/name",
    )
    sources: list[DataSourceConfig] = _f(
        factory=list,
        doc="multi-task: [{name, path, weight, "
        "reward_fn}], drawn by weight; exclusive with train_path",
    )
    fields: dict = _f(
        factory=dict,
        doc="{prompt: <field>, answer: <field>}: record field names "
        "(default: prompt_key / answer_key)",
    )
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: bool = True
    max_prompt_len: int = _f(1024, lo=1)
    shuffle: bool = True
    test_path: str = _f("", doc="held-out prompts (same format as train_path)")
    format: str = _f(
        "auto",
        choices=["auto", "jsonl", "parquet"],
        doc="auto: by file suffix (.parquet / .pq -> parquet, else JSONL)",
    )
    drop_last: bool = _f(True, doc="drop an epoch's incomplete final batch")
    sft_batch_size: int = _f(64, lo=1, doc="examples per SFT step (mode=sft)")
    images: DataImagesConfig = _f(
        factory=DataImagesConfig, doc="images in prompts (vision-language models)"
    )


@dataclass
class EvalConfig:
    """Evaluation during RL training: the rollout worker runs the held-out prompts on the
    rollout servers at the weights just published (outside the staleness bound and the
    training buffer); the trainer logs ``eval/*``. Runs at step 0 (fresh run), every
    ``every_steps`` steps and after the last step."""

    data: list = _f(
        factory=list,
        doc="prompt files (JSONL / parquet, read with the data.* keys); empty = no evaluation",
    )
    every_steps: int = _f(0, lo=0, doc="steps between evaluations; 0 = off")
    n_samples: int = _f(1, lo=1, doc="samples per prompt (pass@k for k = 1, 2, 4, ..)")
    temperature: float = _f(0.0, lo=0.0, doc="0 = greedy")
    top_p: float = _f(1.0, lo=0.0, hi=1.0, lo_open=True)
    max_new_tokens: int = _f(0, lo=0, doc="0 = rollout.max_new_tokens")
    reward_fn: str = _f("", doc="module:function; empty = rollout.reward_fn")
    pass_threshold: float = _f(1.0, doc="a sample is correct when its reward >= this")


@dataclass
class CheckpointConfig:
    dir: str = _f("", doc="empty = <run_dir>/checkpoints")
    save_every: int = _f(0, lo=0, doc="steps between checkpoints (0 = only at the end)")
    keep_last: int = _f(2, lo=1)
    load: str = _f("", doc="checkpoint directory to start from (model only, or full resume)")


@dataclass
class ModelHParams:
    """Architecture numbers of the trained model (the published ``config.json`` values), used
    only by the memory estimate of ``launch.local --dry-run``. Optional: without it the estimate
    reads ``<model.path>/config.json`` or the built-in table of known models."""

    hidden_size: int = _f(0, lo=1)
    num_layers: int = _f(0, lo=1)
    num_attention_heads: int = _f(0, lo=1)
    num_kv_heads: int = _f(0, lo=0, doc="0 = num_attention_heads (no GQA)")
    head_dim: int = _f(0, lo=0, doc="0 = hidden_size / num_attention_heads")
    ffn_hidden_size: int = _f(0, lo=0, doc="dense MLP width (SwiGLU)")
    gated_mlp: bool = _f(True, doc="false: an MLP without a gate (Nemotron's squared ReLU)")
    norm_bias: bool = _f(False, doc="norms with a bias (Nemotron's LayerNorm)")
    vocab_size: int = _f(0, lo=1)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = _f(0, lo=0, doc="0 = dense")
    moe_ffn_hidden_size: int = _f(0, lo=0)
    moe_topk: int = _f(0, lo=0)
    shared_expert_ffn_hidden_size: int = _f(0, lo=0)
    # a vision-language model's vision tower (patch embedding, blocks, merger)
    vision_family: str = _f(
        "qwen2_5_vl",
        choices=["qwen2_5_vl", "qwen3_vl"],
        doc="the tower's layout: Qwen2.5-VL's (RMSNorm, SwiGLU) or Qwen3-VL's (LayerNorm, GELU "
        "MLP, learnt position grid, deepstack mergers)",
    )
    vision_depth: int = _f(0, lo=0, doc="vision tower blocks; 0 = a text model")
    vision_hidden_size: int = _f(0, lo=0)
    vision_intermediate_size: int = _f(0, lo=0, doc="the blocks' MLP width")
    vision_patch_dim: int = _f(
        0, lo=0, doc="one patch's inputs: channels x temporal patch x patch x patch (1176)"
    )
    vision_merge_size: int = _f(
        2, lo=1, doc="spatial merge: merge^2 patches per image token of the language model"
    )
    vision_position_embeddings: int = _f(
        0, lo=0, doc="Qwen3-VL: the learnt position grid's entries (2304 = 48 x 48)"
    )
    vision_deepstack_layers: int = _f(
        0, lo=0, doc="Qwen3-VL: blocks whose features also feed the language model (3)"
    )
