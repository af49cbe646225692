"""Offline conversion between HF directories and megatron ``dist_checkpointing`` checkpoints.

Both directions run in one process (a world-size-1 gloo group) and build the megatron model on
the ``meta`` device only, to learn the exact sharded keys, offsets and factories that
``build_model_chunks`` produces (so the checkpoint is what the engine's models load, under any
TP/PP/VPP/EP layout, by resharding). Tensors are moved one at a time:

* HF → megatron: each HF tensor is read with ``readinto`` (no mmap), mapped with
  :mod:`~areal_mega.checkpoint.hf_mapping`, written to a staging file and handed to
  ``dist_checkpointing.save`` as a lazily mapped (``MAP_PRIVATE``) tensor, so this process holds
  one tensor at a time; megatron's writer process streams the mapped pages to the checkpoint.
* megatron → HF: each megatron tensor is loaded alone with ``dist_checkpointing.load``, mapped
  to its HF tensors and streamed into pre-planned safetensors shards.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import tempfile
from pathlib import Path
from typing import Dict, Optional, Tuple

import torch

from areal_mega.checkpoint import hf_mapping as hm
from areal_mega.checkpoint.bridge_tables import FUSED_EXPERT_KINDS
from areal_mega.checkpoint.dist_ckpt import (
    HF_AUX_FILES,
    HF_SUBDIR,
    CheckpointError,
    atomic_save_sharded,
    resolve_checkpoint,
)
from areal_mega.checkpoint.hf_mapping_moe import is_mtp_tensor
from areal_mega.checkpoint.safetensors_io import (
    SafetensorsDir,
    ShardedSafetensorsWriter,
    split_row_name,
)
from areal_mega.checkpoint.value_model import SCORE_TENSOR, is_sequence_classification
from areal_mega.checkpoint.verify import read_meta
from areal_mega.common.malloc import release_large_buffers
from areal_mega.common.net import free_port
from areal_mega.common.proc_memory import AnonPeak, proc_status_bytes
from areal_mega.parallel.allocation import ParallelDims, expert_tp_size

__all__ = [
    "convert_hf_to_mcore",
    "convert_mcore_to_hf",
    "check_layout",
    "rss_bytes",
    "peak_rss_bytes",
    "reset_peak_rss",
]

_DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DT_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (since the last :func:`reset_peak_rss`)."""
    peak = proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (Linux ``clear_refs`` 5); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def check_layout(
    arch,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: Optional[int] = None,
    vpp: Optional[int] = None,
    where: str = "",
) -> None:
    """Refuse a layout the model cannot be split into, with a message naming the rule
    (``etp``: the experts' tensor parallel size, None: ``tp``)."""
    rules = [
        (arch.num_heads % tp == 0, f"num_attention_heads={arch.num_heads} % TP={tp}"),
        (arch.num_kv_heads % tp == 0, f"num_key_value_heads={arch.num_kv_heads} % TP={tp}"),
        (
            arch.num_layers % (pp * (vpp or 1)) == 0,
            f"num_hidden_layers={arch.num_layers} % (PP·VPP={pp * (vpp or 1)})",
        ),
        (
            not arch.is_moe or arch.num_experts % ep == 0,
            f"num_experts={arch.num_experts} % EP={ep}",
        ),
        (arch.is_moe or ep == 1, f"EP={ep} needs an MoE model"),
        (arch.is_moe or etp in (None, tp), f"expert TP={etp} needs an MoE model"),
    ]
    for ok, rule in rules:
        if not ok:
            raise hm.UnsupportedModelError(f"{where}: layout does not fit: {rule} != 0")
    if arch.model_type == "gpt_oss":
        from areal_mega.models.gpt_oss import layout_refusal

        why = layout_refusal(tp, etp)
        if why:
            raise hm.UnsupportedModelError(f"{where}: {why}")
    if arch.model_type == "gemma4_text":
        from areal_mega.models.gemma4 import layout_refusal

        why = layout_refusal(arch, tp, pp)
        if why:
            raise hm.UnsupportedModelError(f"{where}: {why}")


def _single_process_mesh():
    import torch.distributed as dist

    from areal_mega.parallel.mesh import ParallelMesh

    if dist.is_initialized() and dist.get_world_size() != 1:
        raise RuntimeError("the offline converters run in a single process (world size 1)")
    return ParallelMesh.create(
        ParallelDims(),
        timeout_s=120,
        rank=0,
        world_size=1,
        init_method=f"tcp://127.0.0.1:{free_port()}",
    )


def _meta_sharded_state_dict(arch):
    """The world-size-1 model's ``sharded_state_dict()`` with meta tensors (no memory)."""
    from areal_mega.models.builder import build_model_chunks

    mesh = _single_process_mesh()
    # local spec always: the sharded keys are the same as TE's for dense models (megatron maps
    # them) and the meta device needs no kernels
    with torch.device("meta"):
        chunks, _ = build_model_chunks(arch, mesh, dtype="fp32", use_te=False)
    return chunks[0].sharded_state_dict()


def _tqdm(it, progress: bool, **kw):
    if not progress:
        return it
    from tqdm import tqdm

    return tqdm(it, **kw)


def _score_head_of(hf_dir: Path, weights: SafetensorsDir) -> set:
    """``{"score.weight"}`` for a sequence-classification checkpoint (which must hold it),
    else nothing."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    if not is_sequence_classification(cfg.get("architectures")):
        return set()
    if SCORE_TENSOR not in weights:
        raise hm.UnsupportedModelError(
            f"{hf_dir}: {cfg['architectures'][0]} without a "
            f"{SCORE_TENSOR!r} tensor in its safetensors files"
        )
    return {SCORE_TENSOR}


# ----------------------------------------------------------------------------------------------
# HF -> megatron
# ----------------------------------------------------------------------------------------------


class _Stager:
    """Moves tensors out of process memory into files and maps them back lazily
    (``MAP_PRIVATE``, nothing read until megatron's writer process streams them)."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.n = 0

    def write(self, segments, dtype: Optional[torch.dtype]) -> Tuple[Path, torch.Tensor]:
        """Write row blocks one after the other; returns the file and a mapped tensor of
        the concatenated shape."""
        path = self.dir / f"{self.n}.bin"
        self.n += 1
        rows, tail, dt = 0, None, None
        with open(path, "wb") as f:
            for seg in segments:
                seg = seg.detach()
                if dtype is not None:
                    seg = seg.to(dtype)
                seg = seg.contiguous()
                f.write(seg.reshape(-1).view(torch.uint8).numpy())
                rows += seg.shape[0]
                tail, dt = tuple(seg.shape[1:]), seg.dtype
                del seg
        return path, self.map(path, dt, (rows,) + tail)

    @staticmethod
    def map(path: Path, dtype: torch.dtype, shape, offset: int = 0) -> torch.Tensor:
        import numpy as np

        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        arr = np.memmap(path, dtype=np.uint8, mode="c", offset=offset, shape=(nbytes,))
        return torch.from_numpy(arr).view(dtype).view(tuple(shape))


def convert_hf_to_mcore(
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
    value_model: bool = False,
    progress: bool = True,
) -> Dict[str, object]:
    """Convert an HF model directory to a megatron ``dist_checkpointing`` checkpoint under
    ``out`` (``out/iter_0000000`` + ``out/latest``; loadable by
    :func:`~areal_mega.checkpoint.dist_ckpt.load_checkpoint` under any layout).

    ``tp``/``pp``/``ep``/``etp``/``vpp``: the layout to validate against and pad the vocabulary
    for (the files themselves reshard to any layout; ``etp``: the experts' tensor parallel
    size, None: ``tp``). ``dtype``: ``fp32``/``bf16``/``fp16`` or
    None to keep the HF dtype. ``value_model``: the critic's start, the trunk only (no
    ``output_layer``), from a causal LM (``lm_head`` skipped) or a one-label
    ``*ForSequenceClassification`` (``score.weight`` skipped: it becomes the value head, see
    :mod:`~areal_mega.checkpoint.value_model`). Returns a report dict (path, tensor count,
    memory numbers)."""
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    from areal_mega.models.builder import padded_vocab_size

    hf_dir = Path(hf_dir)
    out = Path(out)
    arch = hm.read_arch(hf_dir, value_model=value_model)
    check_layout(arch, tp=tp, pp=pp, ep=ep, etp=etp, vpp=vpp, where=str(hf_dir / "config.json"))
    weights = SafetensorsDir(hf_dir)
    expected = hm.hf_tensor_names(arch, with_head=not value_model)
    missing = [n for n in expected if n not in weights]
    if missing and missing[0] + "_blocks" in weights:  # the hub's GPT-OSS experts
        raise hm.UnsupportedModelError(
            f"{hf_dir}: tensor {missing[0]!r} is stored MXFP4-quantized ({missing[0]}_blocks / "
            "_scales); convert a bf16 copy (transformers: from_pretrained with "
            "Mxfp4Config(dequantize=True), then save_pretrained)"
        )
    if missing:
        raise hm.UnsupportedModelError(
            f"{hf_dir}: tensor {missing[0]!r} (and {len(missing) - 1} more) not in the "
            f"safetensors files; fused or renamed weights are not supported"
        )
    ignorable = {"lm_head.weight"} if arch.tie_word_embeddings or value_model else set()
    if value_model:
        ignorable |= _score_head_of(hf_dir, weights)
    unexpected = [
        n
        for n in weights.keys()
        if n not in set(expected) | ignorable
        and not n.endswith("rotary_emb.inv_freq")
        and not is_mtp_tensor(arch, n)
    ]
    if unexpected:
        raise hm.UnsupportedModelError(
            f"{hf_dir}: unexpected tensor {unexpected[0]!r} "
            f"(+{len(unexpected) - 1}); unsupported model variant"
        )
    out_dtype = _DT[dtype] if dtype else None
    padded = padded_vocab_size(arch.vocab_size, make_vocab_size_divisible_by, tp)
    sd = _meta_sharded_state_dict(arch)
    if value_model:
        sd = {k: v for k, v in sd.items() if not k.startswith("output_layer.")}
    release_large_buffers()  # each streamed tensor's buffer goes back when freed
    reset_peak_rss()
    baseline = rss_bytes()
    largest = max(
        torch.Size(weights.info(n)[1]).numel()
        * torch.empty((), dtype=weights.info(n)[0]).element_size()
        for n in expected
    )
    out.mkdir(parents=True, exist_ok=True)
    stage_dir = Path(tempfile.mkdtemp(prefix=".stage-", dir=out))
    stage = _Stager(stage_dir)
    src_dtype = None
    try:
        for name in _tqdm(list(sd), progress, desc="HF -> megatron", unit="tensor"):
            entry = sd[name]
            if isinstance(entry, ShardedObject):
                continue
            layer, expert, suffix = hm.parse_mcore_name(name)
            hf_names, kind = hm.hf_names_for(arch, layer, expert, suffix)
            src_dtype = src_dtype or weights.info(hf_names[0])[0]
            segs = hm.to_mcore_segments(arch, kind, hf_names, weights.get, padded_vocab_size=padded)
            fpath, t = stage.write(segs, out_dtype)
            if isinstance(entry, ShardedTensorFactory):
                entry.data = t
                built = entry.build()
                items = built.items() if isinstance(built, dict) else enumerate(built)
                esize = t.element_size()
                for _, piece in items:  # each piece its own mapping: no clone of views
                    d = piece.data
                    if not d.is_contiguous():
                        raise RuntimeError(f"{name}: non-contiguous factory piece")
                    piece.data = stage.map(fpath, d.dtype, d.shape, d.storage_offset() * esize)
                sd[name] = built
            elif isinstance(entry, ShardedTensor):
                if tuple(entry.local_shape) != tuple(t.shape):
                    if kind != "vocab":
                        raise RuntimeError(
                            f"{name}: mapped shape {tuple(t.shape)} != model "
                            f"shape {tuple(entry.local_shape)}"
                        )
                    entry.local_shape = tuple(t.shape)
                    entry.global_shape = tuple(t.shape)
                entry.data = t
            del t
        report_dtype = out_dtype or src_dtype
        meta = {
            "source": "hf",
            "model_type": arch.model_type,
            "dtype": _DT_NAME.get(report_dtype, str(report_dtype)),
            "vocab_size": arch.vocab_size,
            "padded_vocab_size": padded,
            "make_vocab_size_divisible_by": make_vocab_size_divisible_by,
            "target_layout": {
                "tp": tp,
                "pp": pp,
                "ep": ep,
                "etp": expert_tp_size(tp, etp),
                "vpp": vpp or 1,
            },
            "layout": {"world": 1, "tp": 1, "pp": 1, "dp": 1, "ep": 1, "vpp": 1},
            "num_chunks": 1,
            "has_optimizer": False,
            "has_lr_scheduler": False,
            "has_rng": False,
            "extra": {"value_model": True} if value_model else {},
        }
        peak_before_save = peak_rss_bytes()
        with AnonPeak() as save_anon:  # the save maps the staged files: see common/proc_memory.py
            path = atomic_save_sharded(out, 0, {"model": sd}, meta=meta, hf_dir=hf_dir)
    finally:
        shutil.rmtree(stage_dir, ignore_errors=True)
    return {
        "path": str(path),
        "tensors": len(expected),
        "baseline_rss": baseline,
        "peak_rss": peak_rss_bytes(),
        "largest_tensor_bytes": largest,
        "peak_rss_before_save": peak_before_save,
        "save_anon_baseline": save_anon.baseline,
        "save_anon_peak": save_anon.peak,
        "children_peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    }


# ----------------------------------------------------------------------------------------------
# megatron -> HF
# ----------------------------------------------------------------------------------------------


def _section_regions(name: str, entry, pieces) -> list:
    """A world-size-1 parameter that megatron's checkpoint stores as several tensors, one per
    section of its rows (the Mamba mixer's ``in_proj`` as z, x, B, C, dt; its convolution as
    x, B, C): ``[(key, offsets, sizes, section shape)]`` in row order (``offsets`` / ``sizes``
    with the layer axes megatron prepends to a ``GPTModel`` layer's tensors). Each section's global
    tensor stacks every TP rank's slice of it, so the sections are read apart and stacked here.
    RuntimeError when the pieces do not tile the parameter's rows."""
    full = tuple(entry.data.shape)
    out, rows = [], 0
    for p in sorted(pieces, key=lambda p: p.data.storage_offset()):
        shape = tuple(p.local_shape)
        if shape[1:] != full[1:]:
            raise RuntimeError(f"{name}: section {p.key!r} of shape {shape} is not a row block")
        rows += shape[0]
        # a GPTModel layer's tensors are stacked over the layers (prepended axes of one)
        sizes = [1] * p.prepend_axis_num + list(shape)
        out.append((p.key, list(p.global_offset), sizes, shape))
    if rows != full[0]:
        raise RuntimeError(f"{name}: its sections hold {rows} of {full[0]} rows")
    return out


def convert_mcore_to_hf(
    mcore_dir,
    out,
    *,
    dtype: Optional[str] = None,
    max_shard_bytes: int = 2 * 1024**3,
    hf_config_dir=None,
    progress: bool = True,
) -> Dict[str, object]:
    """Convert a checkpoint (a root → its latest, or one ``iter_*`` directory) written by
    :func:`convert_hf_to_mcore` or by training (``save_checkpoint(..., hf_dir=...)``) to an HF
    directory: ``config.json``, tokenizer files, ``model-*.safetensors`` + index.

    ``hf_config_dir``: where config/tokenizer come from when the checkpoint has no ``hf/``.
    ``dtype``: output dtype (default: the checkpoint's). Returns a report dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    from areal_mega.checkpoint.dcp_reader import DcpReader

    path = resolve_checkpoint(mcore_dir)
    cfg_dir = Path(hf_config_dir) if hf_config_dir else path / HF_SUBDIR
    if not (cfg_dir / "config.json").is_file():
        raise CheckpointError(
            f"{cfg_dir / 'config.json'}: missing; the checkpoint has no HF "
            f"config (pass hf_config_dir / --hf-config)"
        )
    arch = hm.read_arch(cfg_dir)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not empty; refusing to overwrite")
    reader = DcpReader(path)
    sd = _meta_sharded_state_dict(arch)
    release_large_buffers()  # each streamed tensor's buffer goes back when freed
    reset_peak_rss()
    baseline = rss_bytes()
    out_dtype = _DT[dtype] if dtype else None

    # plan: every HF tensor's name, dtype and shape, in the order they will be produced
    jobs, plan = [], []
    fused: Dict[str, int] = {}  # fused expert tensor -> experts planned
    for name, entry in sd.items():
        if isinstance(entry, ShardedObject):
            continue
        pieces = entry.build() if isinstance(entry, ShardedTensorFactory) else [entry]
        pieces = list(pieces.values()) if isinstance(pieces, dict) else list(pieces)
        key = pieces[0].key
        for piece in pieces:
            if piece.key not in reader.meta:
                raise CheckpointError(
                    f"{path}: tensor {piece.key!r} (for {name}) is not in the checkpoint"
                )
        layer, expert, suffix = hm.parse_mcore_name(name)
        hf_names, kind = hm.hf_names_for(arch, layer, expert, suffix)
        # sections stored apart (the Mamba mixer's and the gated delta-net's input projection and
        # convolution: one tensor per section, each split across TP on its own)
        if len({piece.key for piece in pieces}) > 1:
            jobs.append((name, _section_regions(name, entry, pieces), None, kind, hf_names, None))
            whole = torch.empty(tuple(entry.data.shape), device="meta")
            plan += [
                (h, out_dtype or reader.dtype(key), tuple(x.shape))
                for h, x in zip(hf_names, hm.to_hf(arch, kind, whole))
            ]
            continue
        # the region of the global tensor this (world-size-1) parameter covers
        ndim = len(pieces[0].global_offset)
        offs = [min(p.global_offset[d] for p in pieces) for d in range(ndim)]
        ends = [
            max(
                p.global_offset[d] + ((1,) * p.prepend_axis_num + tuple(p.local_shape))[d]
                for p in pieces
            )
            for d in range(len(offs))
        ]
        sizes = [e - o for o, e in zip(offs, ends)]
        full_shape = tuple(entry.data.shape)
        if kind == "vocab":  # the checkpoint's padding, whatever the builder would pick
            offs, sizes = [0] * len(offs), list(reader.size(key))
            full_shape = tuple(sizes)
        shapes = [
            tuple(x.shape) for x in hm.to_hf(arch, kind, torch.empty(full_shape, device="meta"))
        ]
        ck_dtype = reader.dtype(key)
        jobs.append((key, offs, sizes, kind, hf_names, full_shape))
        if kind in FUSED_EXPERT_KINDS:  # the fused tensor is written with its last expert
            base, _ = split_row_name(hf_names[0])
            fused[base] = fused.get(base, 0) + 1
            if fused[base] == arch.num_experts:
                plan.append((base, out_dtype or ck_dtype, (arch.num_experts,) + shapes[0]))
            continue
        plan += [(h, out_dtype or ck_dtype, s) for h, s in zip(hf_names, shapes)]
    largest = max(
        torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s in plan
    )
    tmp_out = out.with_name(out.name + ".tmp")
    if tmp_out.exists():
        shutil.rmtree(tmp_out)
    writer = ShardedSafetensorsWriter(tmp_out, plan, max_shard_bytes=max_shard_bytes)
    pending: Dict[str, Dict[int, torch.Tensor]] = {}  # fused expert tensor -> rows so far
    for key, offs, sizes, kind, hf_names, full_shape in _tqdm(
        jobs, progress, desc="megatron -> HF", unit="tensor"
    ):
        if full_shape is None:  # ``offs``: the sections' regions (_section_regions)
            try:
                full = torch.cat([reader.read(k, o, z).view(shape) for k, o, z, shape in offs])
            except (KeyError, OSError, RuntimeError) as e:
                raise CheckpointError(f"{path}: cannot read the sections of {key!r}: {e}") from e
            for h, segs in zip(hf_names, hm.to_hf_segments(arch, kind, full)):
                writer.write(h, [x.to(out_dtype) for x in segs] if out_dtype else segs)
            del full
            continue
        row_axis = len(offs) - len(full_shape)

        def rows(r0: int, r1: int) -> torch.Tensor:
            o, z = list(offs), list(sizes)  # noqa: B023
            o[row_axis] += r0  # noqa: B023
            z[row_axis] = r1 - r0  # noqa: B023
            try:
                return reader.read(key, o, z).view((r1 - r0,) + tuple(full_shape[1:]))  # noqa: B023
            except (KeyError, OSError, RuntimeError) as e:
                raise CheckpointError(f"{path}: cannot read {key!r}: {e}") from e  # noqa: B023

        if kind == "glu":  # gate and up are separate row ranges: read one at a time
            half = full_shape[0] // 2
            for h, (r0, r1) in zip(hf_names, [(0, half), (half, full_shape[0])]):
                seg = rows(r0, r1)
                writer.write(h, [seg.to(out_dtype) if out_dtype else seg])
                del seg
            continue
        if kind == "vocab":
            full = rows(0, arch.vocab_size)
            per_hf = ([full],)
        else:
            full = rows(0, full_shape[0])
            per_hf = hm.to_hf_segments(arch, kind, full)
        if kind in FUSED_EXPERT_KINDS:  # kept until the layer's last expert, then written
            base, e = split_row_name(hf_names[0])
            (seg,) = per_hf[0]
            pending.setdefault(base, {})[e] = seg.to(out_dtype) if out_dtype else seg
            if len(pending[base]) == arch.num_experts:
                slices = pending.pop(base)
                writer.write(base, [slices[i][None] for i in range(arch.num_experts)])
            del full, per_hf
            continue
        for h, segs in zip(hf_names, per_hf):
            writer.write(h, [x.to(out_dtype) for x in segs] if out_dtype else segs)
        del full, per_hf
    writer.close()
    cfg = json.loads((cfg_dir / "config.json").read_text())
    out_dt = out_dtype or plan[0][1]
    cfg["dtype"] = _DT_NAME.get(out_dt, str(out_dt))
    cfg.pop("torch_dtype", None)
    for fn in HF_AUX_FILES:
        if fn != "config.json" and (cfg_dir / fn).is_file():
            shutil.copy2(cfg_dir / fn, tmp_out / fn)
    (tmp_out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if out.exists():
        out.rmdir()
    os.rename(tmp_out, out)
    return {
        "path": str(out),
        "tensors": len(plan),
        "baseline_rss": baseline,
        "peak_rss": peak_rss_bytes(),
        "largest_tensor_bytes": largest,
        "checkpoint": str(path),
        "meta": read_meta(path),
    }
