"""Typed experiment configuration: one dataclass per section, loaded from a recipe YAML and
overridden by dotlist arguments (``actor.lr=1e-6 allocation=sglang:d2+megatron:t2p2``).

Every problem is reported as one :class:`ConfigError` naming the dotted key, the value and what
is allowed. Ranges and choices are declared next to each field (``_f(default, lo=, hi=,
choices=)``), so the schema reads as documentation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from areal_mega.config_checks import validate
from areal_mega.config_logging import LoggingConfig, MlflowConfig, WandbConfig  # noqa: F401
from areal_mega.config_lora import LoraConfig
from areal_mega.config_presets import PRESETS, resolve_algorithm
from areal_mega.config_schema import ConfigError, _build, _f, _merge, parse_overrides
from areal_mega.config_vllm import VllmConfig
from areal_mega.security import api_key_from_env

__all__ = ["ConfigError", "ExperimentConfig", "config_from_dict", "config_to_dict",
           "load_config", "parse_overrides"]


@dataclass
class ClusterConfig:
    n_nodes: int = _f(1, lo=1)
    n_gpus_per_node: int = _f(8, lo=1)
    device: str = _f("auto", choices=["auto", "cpu", "cuda"],
                     doc="auto: cuda when available, else cpu")
    master_addr: str = "127.0.0.1"
    master_port: int = _f(0, lo=0, hi=65535, doc="0 picks a free port")
    dist_timeout_s: float = _f(600.0, lo=1.0)
    gpu_memory_gb: float = _f(80.0, lo=0.0, lo_open=True,
                              doc="usable memory per GPU; --dry-run compares its estimate to it")
    kill_grace_s: float = _f(10.0, lo=0.0, doc="SIGTERM -> SIGKILL grace when stopping processes")
    max_restarts: int = _f(3, lo=0, doc="trainer relaunches after a crash when recover=auto")
    server_ready_timeout_s: float = _f(600.0, lo=1.0,
                                       doc="how long launch.local waits for a rollout server")
    server_base_port: int = _f(30000, lo=1024, hi=65535,
                               doc="multi-node: rollout server k of a node listens on base + k")
    cpu_threads_per_server: int = _f(1, lo=1, doc="cluster.device=cpu: torch threads of each "
                                     "local rollout server")
    cpu_threads_per_trainer_rank: int = _f(0, lo=0, doc="cluster.device=cpu: threads of each "
                                           "trainer rank; 0 = the cores the servers leave")


@dataclass
class ModelConfig:
    path: str = _f("", doc="HF-format model directory (config.json, tokenizer, safetensors)")
    dtype: str = _f("bf16", choices=["fp32", "bf16", "fp16"])
    make_vocab_size_divisible_by: int = _f(128, lo=1)
    recompute_granularity: Optional[str] = _f(None, choices=[None, "full", "selective"])
    attention_backend: str = _f(
        "auto", choices=["auto", "flash", "fused", "unfused", "local"],
        doc="auto: TransformerEngine picks its kernel on GPU, local attention on CPU; flash / "
            "fused / unfused: pin TE's kernel (GPU + TE); local: megatron's local spec "
            "with per-sequence torch SDPA on the packed batch (the only choice on GPU without "
            "TE; no CP)")


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
    lr_decay_steps: int = _f(0, lo=0, doc="steps of the warmup+decay schedule; 0 = the "
                             "trainer's total steps (or warmup_steps + 1 when unknown)")
    use_distributed_optimizer: bool = True


@dataclass
class ActorConfig:
    temperature: float = _f(1.0, lo=0.0, lo_open=True,
                            doc="sampling temperature; logprobs are recomputed at it")
    ppo_n_minibatches: int = _f(1, lo=1)
    prox_logprobs: str = _f("auto", choices=["auto", "recompute"],
                            doc="π_prox of the decoupled loss: auto = taken from the training "
                            "forward (detached) when the step is one optimizer step on the "
                            "weights that define π_prox and nothing reads it before training; "
                            "recompute = always a forward pass of its own (AReaL)")
    share_prompt_prefix: bool = _f(True, doc="samples of a micro-batch with the same prompt "
                                   "compute it once (same results; local attention, no CP/SP)")
    sequence_parallel: bool = False
    virtual_pipeline_size: Optional[int] = _f(None, lo=1)
    logprob_chunk_size: Optional[int] = _f(None, lo=1)
    max_consecutive_skips: int = _f(3, lo=1, doc="training steps in a row whose loss or "
                                    "gradients are non-finite (each skipped: no update "
                                    "applied) before the run stops, naming the likely source")


@dataclass
class RefConfig:
    enabled: bool = _f(False, doc="build a reference model (needed when algorithm.kl_coef > 0)")
    path: str = _f("", doc="defaults to model.path")


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation (``algorithm.opd``): in the trainer (``path``) or
    served (``server_addrs``); exactly one of the two when OPD is on (docs/algorithms.md)."""
    path: str = _f("", doc="HF directory of a teacher run in the trainer as a forward-only "
                   "Megatron engine (like the reference model, on the trainer's layout)")
    dtype: Optional[str] = _f(None, choices=[None, "fp32", "bf16", "fp16"],
                              doc="the in-trainer teacher's dtype; None = model.dtype")
    server_addrs: list = _f(factory=list, doc="host:port of SGLang-compatible servers serving "
                            "the teacher (scored by prompt logprobs through SGLang's /generate"
                            "; not vLLM servers) instead of teacher.path")
    api_key: Optional[str] = _f(None, doc="Bearer key of the teacher servers")
    request_timeout_s: float = _f(600.0, lo=0.0, lo_open=True,
                                  doc="per scoring request to a teacher server")


@dataclass
class CriticConfig:
    enabled: bool = _f(False, doc="build a value model (needed by algorithm.adv_estimator=gae)")
    path: str = _f("", doc="HF directory of the critic's initial weights (an LM: fresh value "
                   "head; a one-label *ForSequenceClassification: its score head); defaults "
                   "to model.path")
    lr: float = _f(1e-5, lo=0.0)
    min_lr: float = _f(0.0, lo=0.0)
    lr_warmup_steps: int = _f(0, lo=0, doc="LR warm-up of the critic's optimizer")
    lr_schedule: str = _f("constant", choices=["constant", "cosine", "linear"])
    lr_decay_steps: int = _f(0, lo=0, doc="0 = total_steps")
    clip_grad: float = _f(1.0, lo=0.0)
    value_loss_coef: float = _f(0.5, lo=0.0, lo_open=True,
                                doc="scale of the value loss (critic has its own optimizer)")
    value_clip: Optional[float] = _f(0.2, lo=0.0, lo_open=True,
                                     doc="clip V - V_old to +-value_clip; None = unclipped")
    warmup_steps: int = _f(0, lo=0, doc="first RL steps in which only the critic trains")
    ppo_n_minibatches: int = _f(1, lo=1)
    bootstrap_truncated: bool = _f(False, doc="bootstrap GAE with the value after the last "
                                   "token of samples cut by max_new_tokens (finish=length)")


@dataclass
class OnlineConfig:
    """The agent gateway of ``rollout.workflow: online`` (docs/workflows.md, "Online RL")."""
    host: str = _f("127.0.0.1", doc="bind address of the gateway; beyond loopback it needs "
                   "admin_api_key and tls_cert/tls_key (or allow_insecure_http)")
    port: int = _f(0, lo=0, hi=65535, doc="gateway port; 0 = any free (written to "
                   "<run_dir>/online_gateway.json)")
    admin_api_key: Optional[str] = _f(None, doc="bearer key of /rl/start_session; unset: a "
                                      "random one in <run_dir>/online_gateway.json (mode 0600)")
    tls_cert: str = _f("", doc="PEM certificate: serve HTTPS")
    tls_key: str = _f("", doc="PEM private key of tls_cert")
    allow_insecure_http: bool = _f(False, doc="let a non-loopback gateway serve plain HTTP "
                                   "(logged; session keys then travel in clear)")
    session_timeout_s: float = _f(600.0, lo=0.0, lo_open=True,
                                  doc="an open session idle this long is dropped (idle)")
    reward_timeout_s: float = _f(60.0, lo=0.0, lo_open=True,
                                 doc="an ended session with no reward this long is dropped "
                                 "(no_reward)")
    group_timeout_s: float = _f(0.0, lo=0.0, doc="a task's group takes no new session after "
                                "this long and trains with what it has; 0 = wait for "
                                "rollout.n_samples sessions")
    max_abs_reward: float = _f(1e6, lo=0.0, lo_open=True, doc="rewards outside +-this are "
                               "refused (422)")
    max_open_sessions: int = _f(1024, lo=1, doc="open sessions at most; more get 503")


@dataclass
class RolloutConfig:
    backend: str = _f("local", choices=["local", "sglang", "vllm"],
                      doc="local: our CPU server; sglang; vllm (rollout.vllm, docs/vllm.md)")
    server_addrs: list = _f(factory=list, doc="external servers host:port; empty = launch ours")
    api_key: Optional[str] = _f(None, doc="bearer key of the rollout servers; unset: "
                                "AREAL_ROLLOUT_API_KEY_FILE / AREAL_ROLLOUT_API_KEY")
    allow_unauthenticated: bool = _f(False, doc="let launch.local --serve-node bind servers "
                                     "on the network without api_key (logged)")
    batch_size: int = _f(16, lo=1, doc="prompt groups per training step")
    n_samples: int = _f(8, lo=1, doc="completions per prompt (GRPO group size)")
    max_new_tokens: int = _f(512, lo=1)
    temperature: float = _f(1.0, lo=0.0)
    top_p: float = _f(1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k: int = _f(-1, lo=-1)
    max_head_offpolicyness: int = _f(0, lo=0, doc="eta: staleness bound in weight versions")
    max_concurrent: int = _f(64, lo=1)
    request_timeout_s: float = _f(3600.0, lo=0.0, lo_open=True)
    request_retries: int = _f(3, lo=0)
    on_episode_failure: str = _f("auto", choices=["auto", "fail", "drop"],
                                 doc="a prompt out of attempts: fail the run, or drop it "
                                 "(counted as dropped_prompts) and go on; auto: fail for "
                                 "rlvr and multi_turn, drop for every other workflow")
    failure_rate_ceiling: float = _f(0.5, lo=0.0, hi=1.0, doc="dropped prompts: the run "
                                     "stops when more than this share of the last "
                                     "failure_window prompts was dropped (1: never)")
    failure_window: int = _f(64, lo=1, doc="prompts (final outcomes, not attempts) over "
                             "which failure_rate_ceiling is measured")
    failure_min_prompts: int = _f(16, lo=1, doc="outcomes in the window before "
                                  "failure_rate_ceiling applies (<= failure_window)")
    weight_update: str = _f("auto", choices=["auto", "disk", "distributed"])
    weight_bucket_mb: int = _f(512, lo=1)
    reward_fn: str = _f("areal_mega.rewards:math_reward",
                        doc="dotted path module:function(prompt, completion, answer, **kw)")
    workflow: str = _f("rlvr", doc="rlvr | multi_turn | online | package.module:Name | "
                       "path/to/file.py:Name (docs/workflows.md)")
    workflow_kwargs: dict = _f(factory=dict, doc="keyword arguments of the workflow")
    openai_port: int = _f(0, lo=0, hi=65535, doc="port of the OpenAI-compatible HTTP endpoint "
                          "(started on first use by a workflow); 0 = any free port")
    turn_discount: float = _f(1.0, lo=0.0, hi=1.0, doc="reward discount per later completion "
                              "when an episode's calls are separate samples")
    mem_fraction_static: float = _f(0.8, lo=0.0, hi=1.0, lo_open=True)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)


@dataclass
class DataplaneConfig:
    endpoint: str = _f("", doc="zmq endpoint; empty = ipc in the run directory")
    control_endpoint: str = _f("", doc="rollout-worker control socket; empty = ipc in run dir")
    secret: Optional[str] = None
    max_queue: int = _f(1024, lo=1, doc="trajectories buffered before senders block")
    max_message_bytes: int = _f(1 << 30, lo=1024)
    sender_window: int = _f(64, lo=1, doc="unacknowledged trajectories per sender before send "
                            "blocks (backpressure)")
    allow_remote: bool = _f(False, doc="let the receiver bind a non-loopback interface")


@dataclass
class SchedulerConfig:
    max_tokens_per_mb: int = _f(8192, lo=1)
    balance_by: str = _f("tokens", choices=["tokens", "flops"])
    flops_linear_coef: float = _f(49152.0, lo=0.0, doc="a in cost a*L + L^2 (~12 x hidden)")
    min_micro_batches: int = _f(1, lo=1)


@dataclass
class AlgorithmConfig:
    name: str = _f("grpo", choices=["grpo", "ppo", "sft"])
    adv_estimator: str = _f("grpo", choices=["grpo", "gae", "reinforce", "rloo",
                                             "reinforce_plus_plus",
                                             "reinforce_plus_plus_baseline", "grpo_passk",
                                             "opo"])
    eps_clip_low: float = _f(0.2, lo=0.0)
    eps_clip_high: Optional[float] = _f(None, lo=0.0, doc="clip-higher; None = eps_clip_low")
    dual_clip_c: Optional[float] = _f(None, lo=1.0, lo_open=True)
    decoupled: bool = _f(True, doc="ratio against pi_prox, importance weight pi_prox/pi_behav")
    behav_imp_weight_cap: Optional[float] = _f(5.0, lo=1.0)
    imp_weight_level: str = _f("token", choices=["token", "sequence", "geometric"],
                               doc="sequence: product over the sequence's tokens; geometric: "
                                   "per-token geometric mean of that product")
    imp_weight_mode: str = _f("mask", choices=["mask", "clamp"],
                              doc="mask: drop tokens/sequences above the cap; clamp: min(w, cap)")
    preset: Optional[str] = _f(None, choices=[None, *PRESETS], doc="sets the keys that define "
                               "an algorithm (docs/algorithms.md); explicit keys win")
    policy_loss: str = _f("ppo", choices=["ppo", "gspo", "cispo", "sapo"],
                          doc="ppo: token-ratio clip; gspo: sequence-ratio clip; cispo: clipped "
                              "detached IS weight (REINFORCE form); sapo: soft gate")
    ratio_level: str = _f("token", choices=["token", "sequence"],
                          doc="sequence = GSPO; must agree with policy_loss (gspo <=> sequence)")
    sapo_tau_pos: float = _f(1.0, lo=0.0, lo_open=True, doc="SAPO gate temperature, A > 0")
    sapo_tau_neg: float = _f(1.05, lo=0.0, lo_open=True, doc="SAPO gate temperature, A <= 0")
    loss_agg: str = _f("token_mean", choices=["token_mean", "seq_mean", "seq_sum_norm"])
    loss_norm_len: Optional[int] = _f(None, lo=1, doc="seq_sum_norm (Dr.GRPO) constant; "
                                                      "None = rollout.max_new_tokens")
    entropy_coef: float = _f(0.0, lo=0.0, doc="entropy bonus weight in the policy loss")
    kl_coef: float = _f(0.0, lo=0.0)
    kl_estimator: str = _f("k3", choices=["k1", "k2", "k3"])
    kl_clamp: Optional[float] = _f(10.0, lo=0.0, lo_open=True, doc="k3 KL value clamped to "
                                   "+-kl_clamp as in verl (k1/k2 never); None = unclamped")
    kl_in_reward: bool = False
    group_norm: bool = True
    group_std: bool = _f(True, doc="divide by the group std (False: Dr.GRPO mean-only)")
    leave_one_out: bool = False
    batch_norm: bool = False
    reward_scale: float = 1.0
    reward_bias: float = 0.0
    reward_clip: Optional[float] = _f(None, lo=0.0, lo_open=True)
    overlong_buffer: int = _f(0, lo=0, doc="DAPO soft overlong penalty length (0 = off)")
    overlong_penalty: float = _f(1.0, lo=0.0)
    zero_reward_without_eos: bool = False
    dynamic_filter: bool = False
    gamma: float = _f(1.0, lo=0.0, hi=1.0)
    lam: float = _f(1.0, lo=0.0, hi=1.0)
    opd: str = _f("off", choices=["off", "pure", "add"], doc="on-policy distillation: pure = "
                  "advantage -opd_coef*(log pi - log pi_teacher) per token instead of the "
                  "outcome advantage; add = the outcome advantage plus it (needs teacher.*)")
    opd_coef: float = _f(1.0, lo=0.0, lo_open=True, doc="scale of the OPD advantage term")
    routing_replay: str = _f("off", choices=["off", "r3"], doc="MoE routing replay: r3 = the "
                             "rollout servers return each token's routed experts (started with "
                             "--enable-return-routed-experts) and the actor's routers replay "
                             "them (MoE models only)")
    routing_replay_free_every: int = _f(10, lo=0, doc="with r3: every N steps one more proximal "
                                        "forward with free routing for moe/mismatch_free and "
                                        "moe/route_agreement (0 = never)")


@dataclass
class DataSourceConfig:
    """One task of a multi-task run (``data.sources``): prompts drawn with probability
    proportional to ``weight``, scored by ``reward_fn``, logged as ``reward/<name>``."""
    name: str = _f("", doc="metric name: reward/<name>; unique")
    path: str = _f("", doc="JSONL / parquet file, a saved HF dataset directory, or "
                           "hf:owner/name[:config][@split]")
    weight: float = _f(1.0, lo=0.0, lo_open=True)
    reward_fn: str = _f("", doc="'package.module:function'; empty = rollout.reward_fn")
    reward_kwargs: dict = _f(factory=dict, doc="extra keyword arguments of reward_fn")
    fields: dict = _f(factory=dict, doc="{prompt: <field>, answer: <field>}; empty = data.fields")


@dataclass
class DataConfig:
    train_path: str = _f("", doc="one source (shorthand for a single entry of data.sources): "
                                 "a file, a saved HF dataset directory or hf:owner/name")
    sources: list[DataSourceConfig] = _f(factory=list, doc="multi-task: [{name, path, weight, "
                                         "reward_fn}], drawn by weight; exclusive with train_path")
    fields: dict = _f(factory=dict, doc="{prompt: <field>, answer: <field>}: record field names "
                                        "(default: prompt_key / answer_key)")
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: bool = True
    max_prompt_len: int = _f(1024, lo=1)
    shuffle: bool = True
    test_path: str = _f("", doc="held-out prompts (same format as train_path)")
    format: str = _f("auto", choices=["auto", "jsonl", "parquet"],
                     doc="auto: by file suffix (.parquet / .pq -> parquet, else JSONL)")
    drop_last: bool = _f(True, doc="drop an epoch's incomplete final batch")
    sft_batch_size: int = _f(64, lo=1, doc="examples per SFT step (mode=sft)")


@dataclass
class EvalConfig:
    """Evaluation during RL training: the rollout worker runs the held-out prompts on the
    rollout servers at the weights just published (outside the staleness bound and the
    training buffer); the trainer logs ``eval/*``. Runs at step 0 (fresh run), every
    ``every_steps`` steps and after the last step."""
    data: list = _f(factory=list, doc="prompt files (JSONL / parquet, read with the data.* "
                    "keys); empty = no evaluation")
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
    vocab_size: int = _f(0, lo=1)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = _f(0, lo=0, doc="0 = dense")
    moe_ffn_hidden_size: int = _f(0, lo=0)
    moe_topk: int = _f(0, lo=0)
    shared_expert_ffn_hidden_size: int = _f(0, lo=0)


@dataclass
class ExperimentConfig:
    name: str = "areal-mega"
    seed: int = _f(1, lo=0)
    total_steps: int = _f(100, lo=1)
    mode: str = _f("rl", choices=["rl", "sft"])
    recover: str = _f("off", choices=["off", "auto"])
    allocation: str = _f("local:d1+megatron:d1",
                         doc="<rollout>:<dims>+<trainer>:<dims>, e.g. sglang:d4t2+megatron:t2p2")
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    dataplane: DataplaneConfig = field(default_factory=DataplaneConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    model_hparams: Optional[ModelHParams] = _f(
        None, doc="published architecture numbers for the --dry-run memory estimate")


# ----------------------------------------------------------------------------- loading


def config_from_dict(data: dict) -> ExperimentConfig:
    """Build and validate an :class:`ExperimentConfig` from a nested dict, after applying
    ``algorithm.preset`` (explicit keys win) and pairing ``policy_loss`` / ``ratio_level``
    (:func:`~areal_mega.config_presets.resolve_algorithm`)."""
    cfg = _build(ExperimentConfig, resolve_algorithm(data or {}))
    validate(cfg)
    return cfg


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None
                ) -> ExperimentConfig:
    """Load a recipe YAML (optional) and apply dotlist overrides; ``rollout.api_key`` left
    unset comes from the environment (:func:`areal_mega.security.api_key_from_env`). Raises
    :class:`ConfigError`."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r}: not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r}: invalid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r}: top level must be a mapping")
    data = _merge(data, parse_overrides(overrides or []))
    rollout = data.get("rollout")
    if not (isinstance(rollout, dict) and rollout.get("api_key")):
        key = api_key_from_env()     # e.g. the Slurm steps: the key never in argv
        if key:
            data = _merge(data, {"rollout": {"api_key": key}})
    return config_from_dict(data)


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
