"""The ``lora`` section of the experiment config (LoRA RL training, :mod:`areal_mega.lora`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from areal_mega.common.errors import ConfigError
from areal_mega.config.schema import _f
from areal_mega.lora.targets import LoraSupportError, check_lora_support, hf_targets
from areal_mega.parallel.allocation import parse_allocation

__all__ = ["LoraConfig", "check_lora", "check_lora_model"]


@dataclass
class LoraConfig:
    enabled: bool = _f(
        False,
        doc="train LoRA adapters on the frozen base model instead of all "
        "weights; the reference model is then the actor with its adapters off",
    )
    rank: int = _f(8, lo=1, doc="adapter rank r (a multiple of the trainer's TP size)")
    alpha: float = _f(
        16.0,
        lo=0.0,
        lo_open=True,
        doc="scaling numerator: updates are (alpha / rank) · B A, as PEFT's lora_alpha",
    )
    dropout: float = _f(0.0, lo=0.0, hi=1.0, lo_open=False, doc="dropout on the adapters' input")
    target_modules: list = _f(
        factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        doc="PEFT module names (q_proj … down_proj, all-linear) or "
        "Megatron-Bridge canonical ones (linear_q … linear_fc2)",
    )
    sync: str = _f(
        "adapter",
        choices=["adapter", "merged"],
        doc="adapter: servers load each version's PEFT adapter through SGLang's LoRA "
        "API; merged: they load full weights with the adapters merged in",
    )


def check_lora(cfg) -> None:
    """Cross-field rules of ``lora`` (pure; raises ``ConfigError`` naming the key): known target
    modules, a supported layout, no LoRA critic, weight updates through files, no reference
    model of another path (the reference of a LoRA run is the actor without adapters)."""
    lo = cfg.lora
    if not lo.enabled:
        return
    try:
        targets = hf_targets(lo.target_modules)
        dims = parse_allocation(cfg.allocation).trainer
        check_lora_support(
            model_type="this model",
            is_moe=False,
            is_mla=False,
            targets=targets,
            rank=lo.rank,
            tp=dims.tp,
            cp=dims.cp,
            critic=cfg.critic.enabled and cfg.mode == "rl",
        )
    except LoraSupportError as e:
        raise ConfigError(str(e)) from None
    if cfg.rollout.weight_update == "distributed":
        raise ConfigError(
            "rollout.weight_update='distributed' with lora.enabled: LoRA runs "
            "publish adapter files the servers load (SGLang's /load_lora_adapter"
            "); use rollout.weight_update=disk (or auto)"
        )
    if cfg.ref.enabled and cfg.ref.path and cfg.ref.path != cfg.model.path:
        raise ConfigError(
            f"ref.path={cfg.ref.path!r} with lora.enabled: the reference model "
            "of a LoRA run is the base model (model.path) with the adapters off; "
            "leave ref.path empty"
        )


def check_lora_model(cfg) -> None:
    """With ``lora.enabled``, refuse a ``model.path`` family the adapters do not serve (MoE
    expert targets, multi-latent attention, gated delta-net layers, vision-language models
    other than Qwen3-VL, and a vision-language model's adapters merged into its weights),
    reading its config.json; does nothing when it cannot be read (the engine checks again)."""
    lo = cfg.lora
    if not lo.enabled or not cfg.model.path:
        return
    try:
        hf = json.loads((Path(cfg.model.path) / "config.json").read_text())
    except (OSError, ValueError):
        return
    dims = parse_allocation(cfg.allocation).trainer
    try:
        check_lora_support(
            model_type=str(hf.get("model_type")),
            is_moe=bool(
                hf.get("num_experts")
                or hf.get("num_local_experts")
                or hf.get("n_routed_experts")
                or hf.get("moe_num_experts")  # Ernie 4.5
            ),
            is_mla=hf.get("kv_lora_rank") is not None,
            targets=hf_targets(lo.target_modules),
            rank=lo.rank,
            tp=dims.tp,
            cp=dims.cp,
            gated_mlp=hf.get("hidden_act") != "relu2",
            linear_attention="linear_attention" in (hf.get("layer_types") or ()),
            hybrid=bool(
                hf.get("layers_block_type")
                or hf.get("hybrid_override_pattern")
                or hf.get("mamba_n_heads")  # Falcon-H1
            ),
            vision_language=hf.get("vision_config") is not None,
        )
    except LoraSupportError as e:
        raise ConfigError(f"{e} (model.path={cfg.model.path!r})") from None
    merged = "mode=sft (its hf_model)" if cfg.mode == "sft" else None
    if cfg.mode == "rl" and lo.sync == "merged":
        merged = "lora.sync=merged"
    if hf.get("vision_config") is not None and merged:
        raise ConfigError(
            f"{merged} with lora.enabled on {hf.get('model_type')} (vision-language): the "
            "adapters of a vision-language model are not merged into its weights (the "
            "vision-language HF export takes no LoRA deltas); in RL use lora.sync=adapter, "
            f"whose PEFT adapters the rollout servers load (model.path={cfg.model.path!r})"
        )
