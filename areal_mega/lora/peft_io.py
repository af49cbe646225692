"""LoRA adapters of a running Megatron model <-> HF PEFT files (``adapter_config.json`` +
``adapter_model.safetensors``), the format ``peft.PeftModel.from_pretrained`` and SGLang's
``/load_lora_adapter`` read.

Each canonical adapter (:mod:`areal_mega.lora.layers`) is one PEFT module: ``linear_in`` is
``lora_A`` (``[r, in]``), ``linear_out`` is ``lora_B`` (``[out, r]``), under the HF name of the
projection (``base_model.model.model.layers.{L}.self_attn.q_proj.lora_A.weight``, from the
family's HF mapping) and the *global* layer index. Tensor-parallel shards are all-gathered along
the axis the full shapes imply (:func:`areal_mega.checkpoint.export.gather_axis`); each pipeline
stage's export source writes its layers, global rank 0 merges them. The scaling is PEFT's
``lora_alpha / r``, the same as the bridge adapters' ``alpha / dim``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from areal_mega.checkpoint import hf_mapping as hm
from areal_mega.checkpoint.bridge_tables import VL_LANGUAGE_PREFIX
from areal_mega.checkpoint.vl_mapping import hf_sources, vl_table
from areal_mega.models.bridge_provider import VL_PROVIDER_FAMILIES

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_config",
    "iter_peft_tensors",
    "write_peft_adapter",
    "load_peft_adapter",
    "read_peft_adapter",
    "PeftFormatError",
    "peft_deltas",
]

ADAPTER_CONFIG = "adapter_config.json"
_PEFT_NAME = re.compile(r"\.layers\.(\d+)\..*\.(\w+)\.lora_[AB]\.weight$")
ADAPTER_WEIGHTS = "adapter_model.safetensors"

#: wrapper suffix -> (HF-mapping suffix of its base weight, adapter slots in HF-name order)
_WRAPPED = {
    "self_attention.linear_qkv": (
        "self_attention.linear_qkv.weight",
        ("adapter_q", "adapter_k", "adapter_v"),
    ),
    "self_attention.linear_proj": ("self_attention.linear_proj.weight", (None,)),
    "mlp.linear_fc1": ("mlp.linear_fc1.weight", ("adapter_gate", "adapter_up")),
    "mlp.linear_fc2": ("mlp.linear_fc2.weight", (None,)),
}


class PeftFormatError(ValueError):
    """A PEFT adapter directory that does not fit this model (names the file and the key)."""


def adapter_config(
    *, rank: int, alpha: float, dropout: float, targets: Sequence[str], base_model: str
) -> dict:
    """The ``adapter_config.json`` of our adapters (PEFT's LoraConfig fields; ``targets`` in
    PEFT names)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "inference_mode": True,
        "base_model_name_or_path": str(base_model),
        "revision": None,
    }


def _full_shapes(arch, slot_hf: str, rank: int) -> Tuple[tuple, tuple]:
    h, hd = arch.hidden_size, arch.head_dim
    out_in = {
        "q_proj": (arch.num_heads * hd, h),
        "k_proj": (arch.num_kv_heads * hd, h),
        "v_proj": (arch.num_kv_heads * hd, h),
        "o_proj": (h, arch.num_heads * hd),
        "gate_proj": (arch.ffn_hidden_size, h),
        "up_proj": (arch.ffn_hidden_size, h),
        "down_proj": (h, arch.ffn_hidden_size),
    }[slot_hf]
    return (rank, out_in[1]), (out_in[0], rank)


def _vl_language_table(arch) -> Optional[dict]:
    """The checkpoint table of a vision-language ``arch`` (its language model's HF names are
    the modules' names in transformers' model: ``model.language_model.layers.N``), or None."""
    return vl_table(arch.model_type) if arch.model_type in VL_PROVIDER_FAMILIES else None


def _adapters(chunk, arch) -> Iterator[Tuple[str, torch.nn.Module, str]]:
    """``(PEFT module prefix, ParallelLinearAdapter, PEFT projection name)`` of a bare chunk."""
    from areal_mega.checkpoint.export import _layer_offsets
    from areal_mega.lora.layers import adapter_wrappers

    offsets = _layer_offsets(chunk)
    vl = _vl_language_table(arch)
    for name, w in adapter_wrappers(chunk):
        parts = name.split(".")
        if vl is not None:  # a vision-language model: adapters on its language model only
            if parts[0] != VL_LANGUAGE_PREFIX[:-1]:
                raise PeftFormatError(f"LoRA on {name}: not the language model's")
            parts = parts[1:]
        if parts[:2] != ["decoder", "layers"] or ".".join(parts[3:]) not in _WRAPPED:
            raise PeftFormatError(f"LoRA on {name}: no PEFT mapping for this module")
        layer = offsets[int(parts[2])]
        base_suffix, slots = _WRAPPED[".".join(parts[3:])]
        if vl is not None:
            base = f"{VL_LANGUAGE_PREFIX}decoder.layers.{layer}.{base_suffix}"
            hf_names, _ = hf_sources(vl, base)
        else:
            hf_names, _ = hm.hf_names_for(arch, layer, None, base_suffix)
        for slot, hf_name in zip(slots, hf_names):
            if slot is not None and slot not in w.adapter:
                continue  # an untargeted projection of a fused linear
            adapter = w.adapter if slot is None else w.adapter[slot]
            module = hf_name[: -len(".weight")]
            yield "base_model.model." + module, adapter, module.rsplit(".", 1)[1]


def _tp_axis(name: str, local, full, tp: int) -> Optional[int]:
    from areal_mega.checkpoint.export import gather_axis

    return gather_axis(name, local, full, tp)


def iter_peft_tensors(
    chunks: Sequence[torch.nn.Module], arch, *, rank: int, tp_group=None, grads: bool = False
) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(PEFT tensor name, full CPU tensor)`` of this pipeline stage's adapters (in the
    parameters' dtype; gradients in fp32); every
    rank of the TP group must iterate together (the gathers are collectives). ``grads``: the
    adapters' reduced gradients (``main_grad`` under DDP) instead of their weights."""
    from megatron.core import parallel_state as ps

    tp_group = tp_group or ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group) if dist.is_initialized() else 1
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        for prefix, adapter, proj in _adapters(chunk, arch):
            full_a, full_b = _full_shapes(arch, proj, rank)
            for key, param, full in (
                ("lora_A", adapter.linear_in.weight, full_a),
                ("lora_B", adapter.linear_out.weight, full_b),
            ):
                name = f"{prefix}.{key}.weight"
                t = param.detach()
                if grads:
                    t = getattr(param, "main_grad", None)
                    t = param.grad if t is None else t
                axis = _tp_axis(name, t.shape, full, tp)
                if axis is not None:
                    parts = [torch.empty_like(t) for _ in range(tp)]
                    dist.all_gather(parts, t.contiguous(), group=tp_group)
                    t = torch.cat(parts, dim=axis)
                yield name, t.to("cpu", copy=True).contiguous()


def peft_deltas(
    tensors: Dict[str, torch.Tensor], *, rank: int, alpha: float
) -> Dict[str, torch.Tensor]:
    """``{HF weight name: (alpha / rank) · B @ A}`` of PEFT-named adapter tensors (fp32)."""
    pieces: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        module, kind = name[len("base_model.model.") :].rsplit(".", 2)[:2]
        pieces.setdefault(module + ".weight", {})[kind] = t
    scale = float(alpha) / int(rank)
    return {w: scale * (p["lora_B"].float() @ p["lora_A"].float()) for w, p in pieces.items()}


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def write_peft_adapter(
    chunks, arch, out, *, config: dict, is_writer: bool, is_source: bool
) -> Path:
    """Write the adapters of ``chunks`` as a PEFT directory at ``out`` (collective over all
    ranks; atomic: ``<out>.tmp`` renamed). ``config``: :func:`adapter_config`. ``is_source``:
    this rank writes its pipeline stage (TP/DP/CP rank 0); ``is_writer``: global rank 0."""
    from safetensors.torch import load_file, save_file

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    tensors = dict(iter_peft_tensors(chunks, arch, rank=config["r"]))
    if is_source and tensors:
        from megatron.core import parallel_state as ps

        stage = ps.get_pipeline_model_parallel_rank()
        save_file(tensors, str(tmp / f".stage-{stage}.safetensors"))
    _barrier()
    if is_writer:
        merged: Dict[str, torch.Tensor] = {}
        for part in sorted(tmp.glob(".stage-*.safetensors")):
            merged.update(load_file(str(part)))
            part.unlink()
        if not merged:
            raise RuntimeError(f"PEFT export to {out}: the model has no LoRA adapters")
        save_file(
            dict(sorted(merged.items())), str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"}
        )
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    _barrier()
    return out


def read_peft_adapter(path) -> Tuple[dict, Dict[str, torch.Tensor]]:
    """``(adapter_config, tensors)`` of a PEFT directory, checked for what we load: LoRA
    without DoRA, rsLoRA, biases, ``modules_to_save`` or per-module ranks. Tensor names are
    normalised to ours (PEFT's optional ``.default`` adapter-name infix removed)."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file, w_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    for f in (cfg_file, w_file):
        if not f.is_file():
            raise PeftFormatError(f"PEFT adapter {path}: {f.name} not found")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise PeftFormatError(f"{cfg_file}: invalid JSON: {e}") from None
    refuse = {
        "peft_type": cfg.get("peft_type") != "LORA",
        "use_dora": bool(cfg.get("use_dora")),
        "use_rslora": bool(cfg.get("use_rslora")),
        "bias": cfg.get("bias", "none") != "none",
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
    }
    bad = [k for k, v in refuse.items() if v]
    if bad:
        raise PeftFormatError(
            f"{cfg_file}: {bad[0]}={cfg.get(bad[0])!r} is not supported (plain LoRA only)"
        )
    tensors = {
        k.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."): v
        for k, v in load_file(str(w_file)).items()
    }
    return cfg, tensors


def _unexpected(tensors, projections: set, num_layers: int) -> List[str]:
    """Names of ``tensors`` that are not ``lora_A``/``lora_B`` of one of ``projections`` in a
    layer below ``num_layers``: adapters the model has no place for (pure)."""
    bad = []
    for name in tensors:
        m = _PEFT_NAME.search(name)
        if m is None or int(m.group(1)) >= num_layers or m.group(2) not in projections:
            bad.append(name)
    return sorted(bad)


def load_peft_adapter(chunks, arch, path, *, rank: int, tp_rank: int, tp: int) -> List[str]:
    """Copy a PEFT adapter directory into the adapters of ``chunks`` (this rank's TP shard of
    each). Its ``r`` must equal ``rank``; its ``lora_alpha`` becomes the adapters' scaling.
    Raises :class:`PeftFormatError` naming a missing or unexpected tensor, or a shape that does
    not fit. Returns the names loaded."""
    cfg, tensors = read_peft_adapter(path)
    if int(cfg.get("r", -1)) != rank:
        raise PeftFormatError(
            f"{Path(path) / ADAPTER_CONFIG}: r={cfg.get('r')} but the model's "
            f"adapters have rank {rank} (lora.rank)"
        )
    alpha = float(cfg.get("lora_alpha", rank))
    found = [
        (prefix, adapter, proj)
        for chunk in chunks
        for prefix, adapter, proj in _adapters(getattr(chunk, "module", chunk), arch)
    ]
    extra = _unexpected(tensors, {proj for _, _, proj in found}, arch.num_layers)
    if extra:
        raise PeftFormatError(
            f"{Path(path) / ADAPTER_WEIGHTS}: {len(extra)} tensors for "
            f"modules the model has no LoRA adapter on, e.g. {extra[:3]} "
            "(lora.target_modules must cover the adapter's target_modules)"
        )
    loaded = []
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        for prefix, adapter, proj in _adapters(chunk, arch):
            adapter.alpha = alpha
            full_a, full_b = _full_shapes(arch, proj, rank)
            for key, param, full in (
                ("lora_A", adapter.linear_in.weight, full_a),
                ("lora_B", adapter.linear_out.weight, full_b),
            ):
                name = f"{prefix}.{key}.weight"
                if name not in tensors:
                    raise PeftFormatError(
                        f"{Path(path) / ADAPTER_WEIGHTS}: {name} missing "
                        "(the model has a LoRA adapter there)"
                    )
                t = tensors[name]
                if tuple(t.shape) != tuple(full):
                    raise PeftFormatError(
                        f"{Path(path) / ADAPTER_WEIGHTS}: {name} has shape "
                        f"{tuple(t.shape)}, the model needs {tuple(full)}"
                    )
                axis = _tp_axis(name, param.shape, full, tp)
                if axis is not None:
                    t = t.chunk(tp, dim=axis)[tp_rank]
                with torch.no_grad():
                    param.copy_(t.to(param.dtype))
                loaded.append(name)
    return loaded
