"""Write a running actor's weights as an HF model directory (the disk weight-update path).

Every trainer rank takes part (the export all-gathers TP/EP shards); the export source of each
pipeline stage (TP rank 0, DP rank 0, CP rank 0) writes that stage's tensors as one
safetensors shard, and global rank 0 writes the index and copies the config/tokenizer files
of the source HF directory. The directory appears atomically (written as ``<out>.tmp``, then
renamed), so a rollout server never loads a half-written model.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path


def _barrier() -> None:
    # imported here: launch.local uses resolve_weight_update and must not pay for torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def export_hf_dir(engine, hf_src_dir, out, *, is_writer: bool, dtype=None, deltas=None) -> Path:
    """Export ``engine``'s model as an HF directory at ``out`` (collective over all ranks).

    ``hf_src_dir``: the HF directory the model was built from (config, tokenizer).
    ``is_writer``: True on global rank 0 (writes index and side files, renames).
    ``dtype``: cast the weights (default: keep the parameters' dtype).
    ``deltas``: ``{HF name: tensor}`` added to those weights (a LoRA actor's merged adapters,
    :func:`areal_mega.lora.actor.merged_deltas`)."""
    from safetensors.torch import save_file

    from areal_mega.checkpoint import hf_mapping as hm
    from areal_mega.checkpoint.dist_ckpt import HF_AUX_FILES
    from areal_mega.checkpoint.export import is_export_source, iter_hf_tensors
    from areal_mega.checkpoint.vl_convert import is_vl_model_dir

    hf_src_dir, out = Path(hf_src_dir), Path(out)
    tmp = out.with_name(out.name + ".tmp")
    if is_writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    vl = is_vl_model_dir(hf_src_dir)
    if vl and deltas:
        raise NotImplementedError("LoRA adapters of a vision-language model are not merged")
    mesh = engine.mesh
    pp, stage = mesh.dims.pp, mesh.pp_rank
    source = is_export_source()
    tensors = {}
    if vl:
        stream, expected = vl_hf_tensors(engine, hf_src_dir, dtype=dtype)
    else:
        arch = hm.read_arch(hf_src_dir)
        stream, expected = iter_hf_tensors(engine.model, arch, dtype=dtype), None
    for name, t in stream:
        if source:
            t = t.detach().to("cpu", copy=True)
            if deltas and name in deltas:
                t = (t.float() + deltas[name]).to(t.dtype)
            tensors[name] = t.contiguous()
    if source:
        shard = f"model-{stage + 1:05d}-of-{pp:05d}.safetensors"
        save_file(tensors, str(tmp / shard), metadata={"format": "pt"})
        manifest = {
            "shard": shard,
            "names": sorted(tensors),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "dtypes": sorted({str(t.dtype) for t in tensors.values() if t.is_floating_point()}),
        }
        (tmp / f".manifest-{stage}.json").write_text(json.dumps(manifest))
    del tensors
    _barrier()
    if is_writer:
        weight_map, total, dtypes = {}, 0, set()
        for m in sorted(tmp.glob(".manifest-*.json")):
            info = json.loads(m.read_text())
            weight_map.update({n: info["shard"] for n in info["names"]})
            total += info["bytes"]
            dtypes.update(info["dtypes"])
            m.unlink()
        expected = set(hm.hf_tensor_names(arch) if expected is None else expected)
        missing = sorted(expected - set(weight_map))
        if missing:
            raise RuntimeError(
                f"HF export to {out}: {len(missing)} tensors missing, e.g. {missing[:3]}"
            )
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                indent=2,
            )
        )
        for f in HF_AUX_FILES:
            if (hf_src_dir / f).exists():
                shutil.copy2(hf_src_dir / f, tmp / f)
        if len(dtypes) == 1:
            _set_config_dtype(tmp / "config.json", dtypes.pop())
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    _barrier()
    return out


def vl_hf_tensors(engine, hf_src_dir, *, dtype=None):
    """``(stream, names)``: this rank's stream of ``(HF name, full tensor)`` of a
    vision-language ``engine``'s model (:func:`~areal_mega.checkpoint.vl_mapping.
    iter_vl_hf_tensors`: collective over the TP group, this pipeline stage's share) and the HF
    names the whole model exports (those of the source checkpoint ``hf_src_dir``)."""
    from areal_mega.checkpoint.safetensors_io import SafetensorsDir
    from areal_mega.checkpoint.vl_mapping import iter_vl_hf_tensors
    from areal_mega.models.builder import load_hf_config

    hf = load_hf_config(hf_src_dir)
    (chunk,) = engine.model_chunks()
    while hasattr(chunk, "module") and not hasattr(chunk, "language_model"):
        chunk = chunk.module  # a mixed-precision wrapper
    stream = iter_vl_hf_tensors(
        chunk, int(hf["text_config"]["vocab_size"]), model_type=hf["model_type"], dtype=dtype
    )
    return stream, set(SafetensorsDir(hf_src_dir).keys())


def _set_config_dtype(config_file: Path, dtype: str) -> None:
    """``config.json``'s dtype (``dtype``, or the older ``torch_dtype`` where the source has
    that key) set to that of the exported tensors (``"torch.bfloat16"`` -> ``"bfloat16"``): a
    bf16 model exported from an fp32 HF directory is no longer fp32, and ``dtype="auto"``
    loaders read it there."""
    if not config_file.exists():
        return
    cfg = json.loads(config_file.read_text())
    key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
    name = dtype.replace("torch.", "")
    if cfg.get(key) != name:
        cfg[key] = name
        config_file.write_text(json.dumps(cfg, indent=2) + "\n")


def resolve_weight_update(mode: str, *, cuda: bool, pp: int, lora: bool = False) -> str:
    """``rollout.weight_update`` -> ``disk`` or ``distributed`` (pure).

    ``auto``: bucketed broadcast on GPU (NCCL) with one pipeline stage, the disk otherwise.
    The broadcast path sends from trainer rank 0, so it needs the whole model on one stage.
    A LoRA run (``lora``) always publishes files: a PEFT adapter of a few MiB (or merged
    weights), loaded by the servers from disk."""
    if mode not in ("auto", "disk", "distributed"):
        raise ValueError(f"rollout.weight_update={mode!r}: must be auto, disk or distributed")
    if lora:
        if mode == "distributed":
            raise ValueError(
                "rollout.weight_update='distributed' with lora.enabled: LoRA runs "
                "publish adapter files the servers load (SGLang's "
                "/load_lora_adapter); use rollout.weight_update=disk (or auto)"
            )
        return "disk"
    if mode == "auto":
        return "distributed" if cuda and pp == 1 else "disk"
    if mode == "distributed" and pp > 1:
        raise ValueError(
            f"rollout.weight_update='distributed' with pipeline parallel size {pp}:"
            " the bucketed broadcast sends from rank 0 and needs p=1; use "
            "rollout.weight_update=disk (or auto)"
        )
    return mode


__all__ = ["export_hf_dir", "resolve_weight_update", "vl_hf_tensors"]
