"""Vision-language checkpoints (Qwen2.5-VL) HF <-> megatron ``dist_checkpointing``, as
``tools/convert_hf_to_mcore.py`` / ``tools/convert_mcore_to_hf.py`` run them for a
vision-language config.

Unlike the text families' streaming converters (:mod:`areal_mega.checkpoint.convert`, one
tensor at a time), these build the whole model on the CPU (:func:`areal_mega.models.vlm.builder.
build_vl_model_chunks`, one rank) and move its tensors through the bridge's table
(:mod:`areal_mega.checkpoint.vl_mapping`): memory is the model's size in fp32, and the
checkpoint is written for (and checked against) the single-rank layout, which is the only one
the vision-language builder runs for now. The saved keys are the model's
``sharded_state_dict()`` keys, so the engine's loader reads them like any checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Optional

import torch

from areal_mega.checkpoint.convert import _DT, _DT_NAME, _single_process_mesh
from areal_mega.checkpoint.dist_ckpt import (
    HF_AUX_FILES,
    HF_SUBDIR,
    CheckpointError,
    atomic_save_sharded,
    load_checkpoint,
    resolve_checkpoint,
)
from areal_mega.checkpoint.hf_mapping import UnsupportedModelError
from areal_mega.checkpoint.safetensors_io import SafetensorsDir, ShardedSafetensorsWriter
from areal_mega.checkpoint.verify import read_meta
from areal_mega.checkpoint.vl_mapping import load_hf_weights, to_hf_state_dict
from areal_mega.models.builder import load_hf_config
from areal_mega.models.vlm.builder import build_vl_model_chunks
from areal_mega.models.vlm.config import check_vl_config, is_vl_config

__all__ = [
    "is_vl_model_dir",
    "checkpoint_config_dir",
    "convert_vl_hf_to_mcore",
    "convert_vl_mcore_to_hf",
]


def is_vl_model_dir(model_dir) -> bool:
    """Whether ``model_dir``'s ``config.json`` is a vision-language model we convert."""
    path = Path(model_dir) / "config.json"
    return path.is_file() and is_vl_config(json.loads(path.read_text()))


def checkpoint_config_dir(mcore_dir, hf_config_dir=None) -> Path:
    """Where a checkpoint's HF config is: ``hf_config_dir``, else the checkpoint's ``hf/``."""
    if hf_config_dir:
        return Path(hf_config_dir)
    return resolve_checkpoint(mcore_dir) / HF_SUBDIR


def _single_rank_layout(tp, pp, ep, vpp, etp=None) -> None:
    if (tp, pp, ep, vpp or 1, etp or 1) != (1, 1, 1, 1, 1):
        raise UnsupportedModelError(
            f"vision-language checkpoints are converted for the single-rank layout only "
            f"(got tp={tp} pp={pp} ep={ep} etp={etp} vpp={vpp}); data parallelism loads them "
            "as they are"
        )


def _build(hf: dict, make_vocab_size_divisible_by: int):
    mesh = _single_process_mesh()
    (model,), _ = build_vl_model_chunks(
        hf,
        mesh,
        dtype="fp32",
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        use_te=False,
    )
    return mesh, model


def _copy_aux(src: Path, dst: Path) -> None:
    for fn in HF_AUX_FILES:
        if (src / fn).is_file():
            shutil.copy2(src / fn, dst / fn)


def convert_vl_hf_to_mcore(
    hf_dir,
    out,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
    dtype: Optional[str] = None,
    make_vocab_size_divisible_by: int = 128,
) -> Dict[str, object]:
    """An HF vision-language model directory to a checkpoint under ``out`` (``iter_0000000``,
    ``latest``, ``hf/`` with the config, tokenizer and image processor). ``dtype``: the
    checkpoint's (None: the HF tensors')."""
    hf_dir, out = Path(hf_dir), Path(out)
    _single_rank_layout(tp, pp, ep, vpp, etp)
    hf = load_hf_config(hf_dir)
    try:
        check_vl_config(hf)
    except ValueError as e:
        raise UnsupportedModelError(f"{hf_dir / 'config.json'}: {e}") from None
    weights = SafetensorsDir(hf_dir)
    src_dtype = weights.info(weights.keys()[0])[0]
    out_dtype = _DT[dtype] if dtype else src_dtype
    mesh, model = _build(hf, make_vocab_size_divisible_by)
    try:
        used = load_hf_weights(model, weights, model_type=hf["model_type"])
        model.to(out_dtype)
        padded = model.language_model.embedding.word_embeddings.weight.shape[0]
        meta = {
            "source": "hf",
            "model_type": hf["model_type"],
            "dtype": _DT_NAME.get(out_dtype, str(out_dtype)),
            "vocab_size": int(hf["text_config"]["vocab_size"]),
            "padded_vocab_size": int(padded),
            "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
            "target_layout": {"tp": 1, "pp": 1, "ep": 1, "vpp": 1},
            "layout": {"world": 1, "tp": 1, "pp": 1, "dp": 1, "ep": 1, "vpp": 1},
            "num_chunks": 1,
            "has_optimizer": False,
            "has_lr_scheduler": False,
            "has_rng": False,
            "extra": {},
        }
        path = atomic_save_sharded(
            out, 0, {"model": model.sharded_state_dict()}, meta=meta, hf_dir=hf_dir
        )
    finally:
        mesh.destroy()
    return {"path": str(path), "tensors": len(used)}


def convert_vl_mcore_to_hf(
    mcore_dir,
    out,
    *,
    dtype: Optional[str] = None,
    hf_config_dir=None,
    max_shard_bytes: int = 2 * 1024**3,
) -> Dict[str, object]:
    """A vision-language checkpoint to an HF directory (``config.json``, tokenizer, image
    processor, ``model-*.safetensors`` + index). ``dtype``: the output's (None: the
    checkpoint's)."""
    path = resolve_checkpoint(mcore_dir)
    cfg_dir = checkpoint_config_dir(mcore_dir, hf_config_dir)
    if not (cfg_dir / "config.json").is_file():
        raise CheckpointError(
            f"{cfg_dir / 'config.json'}: missing; the checkpoint has no HF config "
            "(pass hf_config_dir / --hf-config)"
        )
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not empty; refusing to overwrite")
    hf = load_hf_config(cfg_dir)
    meta = read_meta(path)
    ck_dtype = getattr(torch, meta.get("dtype", "float32"))
    out_dtype = _DT[dtype] if dtype else ck_dtype
    mesh, model = _build(hf, int(meta.get("make_vocab_size_divisible_by", 128)))
    try:
        model.to(ck_dtype)
        load_checkpoint(path, [model], load_optimizer=False, load_rng=False)
        tensors = to_hf_state_dict(
            model, int(hf["text_config"]["vocab_size"]), model_type=hf["model_type"]
        )
    finally:
        mesh.destroy()
    plan = [(n, out_dtype, tuple(t.shape)) for n, t in tensors.items()]
    tmp_out = out.with_name(out.name + ".tmp")
    if tmp_out.exists():
        shutil.rmtree(tmp_out)
    writer = ShardedSafetensorsWriter(tmp_out, plan, max_shard_bytes=max_shard_bytes)
    for n, t in tensors.items():
        writer.write(n, [t.to(out_dtype)])
    writer.close()
    _copy_aux(cfg_dir, tmp_out)
    cfg = json.loads((cfg_dir / "config.json").read_text())
    cfg["dtype"] = _DT_NAME.get(out_dtype, str(out_dtype))
    cfg.pop("torch_dtype", None)
    (tmp_out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    os.rename(tmp_out, out)
    return {"path": str(out), "tensors": len(plan), "checkpoint": str(path)}
