"""Offline export of a LoRA run's checkpoint: its adapters as a PEFT directory, or the base model
with the adapters merged in (``tools/export_lora.py``).

A LoRA checkpoint (:func:`areal_mega.lora.actor.checkpoint_extra`) holds the adapters and their
optimizer state only; its ``extra["lora"]`` records rank, alpha, the PEFT targets and the base
model (path and :func:`~areal_mega.run_dir.hf_source_identity`). The adapters are small, so they
are read straight from the DCP files (:class:`~areal_mega.checkpoint.dcp_reader.DcpReader`,
no model, no process group): each is saved layer-stacked under
``decoder.layers.<module>.adapter[.<slot>].linear_{in,out}.weight`` (``[layers, ...]``, TP
shards already global), and layer ``L`` of it is PEFT's ``lora_A`` / ``lora_B`` of the HF
projection the family's mapping names (:data:`areal_mega.lora.peft_io._WRAPPED`).

Every adapter tensor is stored with plain TP sharding (the gate/up adapters too:
:class:`areal_mega.lora.layers.SplitFC1LoRA` saves them without megatron's SwiGLU sharding), so
the stored tensors are the full ones whatever layout saved them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import torch

from areal_mega.checkpoint import hf_mapping as hm
from areal_mega.checkpoint.dist_ckpt import CheckpointError, resolve_checkpoint
from areal_mega.checkpoint.verify import read_meta
from areal_mega.lora.peft_io import (
    _WRAPPED,
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    adapter_config,
    peft_deltas,
)
from areal_mega.run_dir import hf_source_identity

__all__ = [
    "LoraCheckpoint",
    "open_lora_checkpoint",
    "checkpoint_peft_tensors",
    "export_peft_adapter",
    "merge_into_base",
]

_PREFIX = "decoder.layers."
_PEFT_KIND = {"linear_in": "lora_A", "linear_out": "lora_B"}


@dataclass
class LoraCheckpoint:
    """One LoRA checkpoint: its ``iter_*`` directory, iteration, ``lora`` record and base."""

    path: Path
    iteration: int
    record: dict
    base: Path
    arch: object


def _check_base(record: dict, base: Path, where: Path, check_identity: bool) -> None:
    if not (base / "config.json").is_file():
        raise CheckpointError(
            f"{base / 'config.json'}: missing; the base model of {where} "
            "is not there (pass --base DIR)"
        )
    if not check_identity:
        return
    saved = record.get("base_identity") or {}
    mine = hf_source_identity(base)
    for key in ("config_sha256", "weights"):
        if saved.get(key) != mine.get(key):
            raise CheckpointError(
                f"{where}: its adapters were trained on {record.get('base_model')!r}, but the "
                f"{key} of {str(base)!r} differs from the one recorded in "
                f"{where / 'areal_meta.json'} (another model, or its files were rewritten; "
                "--ignore-base-identity skips this check)"
            )


def open_lora_checkpoint(path, *, base=None, check_identity: bool = True) -> LoraCheckpoint:
    """Resolve ``path`` (a checkpoint root → its latest, or one ``iter_*`` directory), verify
    it, and check it is a LoRA checkpoint whose base model (``base``, default the recorded
    path) has the recorded identity. Raises :class:`CheckpointError` naming the file."""
    ckpt = resolve_checkpoint(path)
    meta = read_meta(ckpt)
    record = (meta.get("extra") or {}).get("lora")
    if not record:
        raise CheckpointError(
            f"{ckpt / 'areal_meta.json'}: not a LoRA checkpoint (no "
            "extra['lora'] record); it holds full weights — export it with "
            "tools/convert_mcore_to_hf.py"
        )
    for key in ("rank", "alpha", "targets"):
        if key not in record:
            raise CheckpointError(f"{ckpt / 'areal_meta.json'}: extra['lora'] lacks {key!r}")
    if base is None:
        if not record.get("base_model"):
            raise CheckpointError(
                f"{ckpt / 'areal_meta.json'}: records no base model path (pass --base DIR)"
            )
        base = record["base_model"]
    base = Path(base)
    _check_base(record, base, ckpt, check_identity)
    arch = hm.read_arch(base)
    return LoraCheckpoint(
        path=ckpt, iteration=int(meta.get("iteration", 0)), record=record, base=base, arch=arch
    )


def _peft_name(arch, key: str, layer: int) -> str:
    """The PEFT tensor name of layer ``layer`` of the saved adapter tensor ``key``."""
    rest = key[len(_PREFIX) : -len(".weight")]
    module, _, tail = rest.partition(".adapter.")
    parts = tail.split(".")
    slot, kind = (None, parts[0]) if len(parts) == 1 else (parts[0], parts[1])
    if module not in _WRAPPED or kind not in _PEFT_KIND or len(parts) > 2:
        raise CheckpointError(f"adapter tensor {key!r}: no PEFT mapping for it")
    base_suffix, slots = _WRAPPED[module]
    if slot not in slots:
        raise CheckpointError(f"adapter tensor {key!r}: unknown slot {slot!r} of {module}")
    hf_names, _ = hm.hf_names_for(arch, layer, None, base_suffix)
    module_hf = hf_names[slots.index(slot)][: -len(".weight")]
    return f"base_model.model.{module_hf}.{_PEFT_KIND[kind]}.weight"


def checkpoint_peft_tensors(ck: LoraCheckpoint) -> Dict[str, torch.Tensor]:
    """``{PEFT tensor name: fp32 tensor}`` of every adapter in the checkpoint, checked against
    the recorded rank and the base model's shapes."""
    from areal_mega.checkpoint.dcp_reader import DcpReader
    from areal_mega.lora.peft_io import _full_shapes

    reader = DcpReader(ck.path)
    keys = sorted(
        k
        for k in reader.meta
        if k.startswith(_PREFIX) and ".adapter." in k and k.endswith(".weight")
    )
    if not keys:
        raise CheckpointError(f"{ck.path}: records a LoRA run but holds no adapter tensors")
    rank, out = int(ck.record["rank"]), {}
    for key in keys:
        size = reader.size(key)
        try:
            stacked = reader.read(key, [0] * len(size), size, dtype=torch.float32)
        except (KeyError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{ck.path}: cannot read {key!r}: {e}") from e
        if stacked.dim() != 3 or size[0] != ck.arch.num_layers:
            raise CheckpointError(
                f"{ck.path}: adapter tensor {key!r} has shape {tuple(size)}; "
                f"expected [{ck.arch.num_layers} layers, ., .] for "
                f"{ck.base}"
            )
        for layer in range(size[0]):
            name = _peft_name(ck.arch, key, layer)
            proj = name.split(".")[-3]
            full_a, full_b = _full_shapes(ck.arch, proj, rank)
            want = full_a if ".lora_A." in name else full_b
            if tuple(stacked[layer].shape) != tuple(want):
                raise CheckpointError(
                    f"{ck.path}: {key!r} layer {layer} has shape "
                    f"{tuple(stacked[layer].shape)}; {name} of rank {rank} "
                    f"on {ck.base} needs {tuple(want)}"
                )
            out[name] = stacked[layer].clone()
    return dict(sorted(out.items()))


def _fresh_out(out: Path) -> Path:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not empty; refusing to overwrite")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _publish(tmp: Path, out: Path) -> None:
    if out.exists():
        out.rmdir()
    tmp.rename(out)


def export_peft_adapter(ck: LoraCheckpoint, out) -> dict:
    """Write the checkpoint's adapters as a PEFT directory ``out`` (``adapter_config.json`` +
    ``adapter_model.safetensors``; atomic, refuses a non-empty ``out``). Returns a report."""
    from safetensors.torch import save_file

    out = Path(out)
    tensors = checkpoint_peft_tensors(ck)
    tmp = _fresh_out(out)
    cfg = adapter_config(
        rank=ck.record["rank"],
        alpha=ck.record["alpha"],
        dropout=0.0,
        targets=ck.record["targets"],
        base_model=str(ck.base),
    )
    save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    _publish(tmp, out)
    return {
        "path": str(out),
        "tensors": len(tensors),
        "checkpoint": str(ck.path),
        "iteration": ck.iteration,
        "base": str(ck.base),
    }


def merge_into_base(
    ck: LoraCheckpoint, out, *, max_shard_bytes: int = 2 * 1024**3, progress: bool = True
) -> dict:
    """Write a full HF model directory ``out``: the base model's files with every adapted
    weight ``W + (alpha / r) · B @ A`` (summed in fp32, stored in ``W``'s dtype), tensor by
    tensor (atomic, refuses a non-empty ``out``). Returns a report."""
    from areal_mega.checkpoint.dist_ckpt import HF_AUX_FILES
    from areal_mega.checkpoint.safetensors_io import SafetensorsDir, ShardedSafetensorsWriter

    out = Path(out)
    deltas = peft_deltas(
        checkpoint_peft_tensors(ck), rank=ck.record["rank"], alpha=ck.record["alpha"]
    )
    weights = SafetensorsDir(ck.base)
    missing = sorted(set(deltas) - set(weights.keys()))
    if missing:
        raise CheckpointError(
            f"{ck.base}: has no weight {missing[0]!r} for the adapter of {ck.path}"
        )
    names = weights.keys()
    plan = [(n, *weights.info(n)) for n in names]
    tmp = _fresh_out(out)
    writer = ShardedSafetensorsWriter(tmp, plan, max_shard_bytes=max_shard_bytes)
    it = names
    if progress:
        from tqdm import tqdm

        it = tqdm(names, desc="merge LoRA", unit="tensor")
    for name in it:
        w = weights.get(name)
        if name in deltas:
            w = (w.float() + deltas[name]).to(w.dtype)
        writer.write(name, [w])
        del w
    writer.close()
    for fn in HF_AUX_FILES:
        if (ck.base / fn).is_file():
            shutil.copy2(ck.base / fn, tmp / fn)
    _publish(tmp, out)
    return {
        "path": str(out),
        "tensors": len(plan),
        "merged": len(deltas),
        "checkpoint": str(ck.path),
        "iteration": ck.iteration,
        "base": str(ck.base),
    }
