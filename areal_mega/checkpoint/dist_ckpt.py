"""Training checkpoints with megatron-core ``dist_checkpointing``: atomic, reshardable.

Layout under a checkpoint root::

    <root>/iter_0000010/            one checkpoint (megatron torch_dist files + ours)
        metadata.json, .metadata, __*_*.distcp     (megatron / torch DCP; the common state
                                                   is a DCP object since megatron-core 0.19,
                                                   common.pt before)
        areal_meta.json                                       (ours, written last)
        hf/config.json, tokenizer files                       (to convert back to HF)
    <root>/latest                   "iter_0000010\\n", replaced atomically

A checkpoint is written into ``iter_XXXXXXX.tmp``, every file fsynced, ``areal_meta.json``
(with ``"complete": true``) written last, then renamed; only then does ``latest`` move (write
to a temp file, fsync, rename). A crash at any point leaves ``latest`` on the previous complete
checkpoint, and ``*.tmp`` directories are never picked up.

What is saved: the model chunks' ``sharded_state_dict()`` (so any TP/PP/VPP/EP layout can load
it), the optimizer state (megatron's regular optimizers: their own ``sharded_state_dict()``; the
distributed optimizer: a model-space format of ours, reshardable like the weights, see
:mod:`~areal_mega.checkpoint.distopt_state`; either kind loads into the other,
:mod:`~areal_mega.checkpoint.optimizer_switch`), the LR scheduler's ``state_dict()``, every
rank's RNG states (restored only when the layout is unchanged), and an ``extra`` JSON-able
dict from the trainer.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from areal_mega.checkpoint import checksums as cks
from areal_mega.checkpoint.distopt_state import FORMAT as DISTOPT_FORMAT
from areal_mega.checkpoint.distopt_state import (
    distopt_load_state,
    distopt_sharded_state,
    distributed_optimizers,
)
from areal_mega.checkpoint.finite_weights import NonFiniteWeightsError, nonfinite_parameters
from areal_mega.checkpoint.optimizer_switch import (
    distributed_state_for_regular,
    load_distributed_into_regular,
    load_regular_into_distributed,
    regular_state_for_distributed,
)
from areal_mega.checkpoint.verify import (
    CheckpointError,
    gather_all,
    read_meta,
    verify_checkpoint,
    verify_collective,
)
from areal_mega.common.files import atomic_write, fsync_path
from areal_mega.run_dir import ITER_RE, META_NAME, complete_checkpoints, find_latest, iter_dir_name

logger = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "NonFiniteWeightsError",
    "LoadedCheckpoint",
    "save_checkpoint",
    "load_checkpoint",
    "find_latest",
    "latest_verified",
    "resolve_checkpoint",
    "verify_checkpoint",
    "prune_checkpoints",
    "iter_dir_name",
    "atomic_save_sharded",
    "META_NAME",
    "HF_SUBDIR",
]

HF_SUBDIR = "hf"
HF_AUX_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "preprocessor_config.json",  # a vision-language model's image processor
)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` found: where, which iteration, the trainer's ``extra``."""

    path: Path
    iteration: int
    extra: Dict[str, Any] = field(default_factory=dict)
    meta: Dict[str, Any] = field(default_factory=dict)
    loaded_optimizer: bool = False
    loaded_rng: bool = False


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for fn in files:
            fsync_path(Path(dirpath) / fn)
        fsync_path(dirpath)


# ----------------------------------------------------------------------------------------------
# finding and checking checkpoints
# ----------------------------------------------------------------------------------------------


def _resolve(path) -> Path:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: does not exist")
    if not (path / META_NAME).exists() and not (path / "metadata.json").exists():
        latest = find_latest(path)
        if latest is None:
            raise CheckpointError(
                f"{path}: no complete checkpoint found (no 'latest' pointer "
                f"and no complete iter_* directory)"
            )
        path = latest
    return path


def resolve_checkpoint(path) -> Path:
    """A checkpoint root (→ its latest) or one ``iter_*`` directory, verified (no fallback:
    a corrupt latest checkpoint is an error naming the file)."""
    path = _resolve(path)
    verify_checkpoint(path)
    return path


_JUST_VERIFIED: set = set()  # latest_verified's answer, so the next load does not hash again


def latest_verified(root) -> Optional[Path]:
    """The checkpoint a resuming trainer loads: the newest complete one under ``root`` whose
    files all match their checksums. Collective (each rank hashes a share of the files).

    A corrupt one is skipped with a warning naming the bad file and, once an intact older one
    is found, moved aside to ``iter_N.corrupt`` (kept as evidence; ``latest`` is rewritten to
    the intact one, so the run can save iteration N again). Returns None when ``root`` holds
    no complete checkpoint; raises :class:`CheckpointError` (naming every bad file, moving
    nothing) when every complete checkpoint is corrupt."""
    root = Path(root)
    first = find_latest(root)
    if first is None:
        return None

    def num(p):
        return int(ITER_RE.match(p.name).group(1))

    older = [p for p in reversed(complete_checkpoints(root)) if num(p) < num(first)]
    bad: List[Tuple[Path, str]] = []
    for cand in [first] + older:
        try:
            verify_collective(cand)
        except CheckpointError as e:
            if _rank() == 0:
                logger.warning("not resuming from %s: %s", cand, e)
            bad.append((cand, str(e)))
            continue
        if bad and _rank() == 0:
            for p, _ in bad:
                dst, k = p.with_name(p.name + ".corrupt"), 1
                while dst.exists():
                    dst, k = p.with_name(f"{p.name}.corrupt.{k}"), k + 1
                try:
                    os.rename(p, dst)
                    logger.warning(
                        "moved corrupt checkpoint %s aside to %s; resuming from %s",
                        p,
                        dst.name,
                        cand,
                    )
                except OSError as e:
                    logger.warning("could not move corrupt checkpoint %s aside: %s", p, e)
            atomic_write(root / "latest", cand.name + "\n", durable=True)
        _barrier()
        _JUST_VERIFIED.add(str(cand))
        return cand
    raise CheckpointError(
        f"{root}: no intact checkpoint to resume from; every complete "
        f"checkpoint is corrupt: " + "; ".join(e for _, e in bad)
    )


def prune_checkpoints(root, keep_last: int) -> List[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints (never the one ``latest``
    names) and stale ``*.tmp`` directories. Returns what was deleted."""
    root = Path(root)
    done = complete_checkpoints(root)
    latest = find_latest(root)
    doomed = [p for p in done[: max(0, len(done) - max(1, keep_last))] if p != latest]
    doomed += [p for p in root.glob("iter_*.tmp") if p.is_dir()]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


# ----------------------------------------------------------------------------------------------
# saving
# ----------------------------------------------------------------------------------------------


def in_process_write_results() -> bool:
    """Give megatron-core's checkpoint writer an in-process results queue.

    Its ``FileSystemWriterAsync`` collects the writer threads' results in a process-global
    queue that it creates as a ``multiprocessing`` Manager queue: a spawned helper process
    (which re-imports the caller's ``__main__``: seconds of CPU per process, on the first
    save) needed only when the write runs in another process. Our saves are synchronous, in
    this process, so a thread-safe ``queue.Queue`` carries the same results. Returns whether
    the queue is ours (False: megatron-core no longer has the global; it then makes its own)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()
    return isinstance(getattr(filesystem_async, "_results_queue", None), queue.Queue)


def atomic_save_sharded(
    root,
    iteration: int,
    sharded_state_dict: dict,
    *,
    meta: Optional[dict] = None,
    hf_dir=None,
    keep_last: Optional[int] = None,
) -> Path:
    """Save a megatron sharded state dict as ``<root>/iter_XXXXXXX`` atomically (collective:
    every rank calls it). ``meta`` goes into ``areal_meta.json``; ``hf_dir``'s config and
    tokenizer files are copied to ``hf/``. Returns the final directory."""
    from megatron.core import dist_checkpointing

    from areal_mega.compat import megatron_cpu

    megatron_cpu.apply()  # no-op with CUDA; on CPU it also covers the checkpoint writer
    root = Path(root)
    final = root / iter_dir_name(iteration)
    tmp = root / (final.name + ".tmp")
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        if final.exists():
            raise CheckpointError(f"{final}: already exists; refusing to overwrite")
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    in_process_write_results()
    dist_checkpointing.save(sharded_state_dict, str(tmp))
    _barrier()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if _rank() == 0 and hf_dir is not None:
        (tmp / HF_SUBDIR).mkdir()
        for fn in HF_AUX_FILES:
            src = Path(hf_dir) / fn
            if src.is_file():
                shutil.copy2(src, tmp / HF_SUBDIR / fn)
    # each rank hashes the shards it wrote (in its page cache), rank 0 the rest
    sums = gather_all(cks.hash_files(tmp, cks.save_share(cks.list_files(tmp), _rank(), world)))
    if _rank() == 0:
        files = {k: v for part in sums for k, v in part.items()}
        files.update(cks.hash_files(tmp, set(cks.list_files(tmp)) - set(files)))
        _fsync_tree(tmp)
        m = dict(meta or {})
        m.update(iteration=iteration, complete=True, format="areal-mega/dist_checkpointing/1")
        m = cks.seal(m, files)
        with open(tmp / META_NAME, "w") as f:
            json.dump(m, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(tmp)
        os.rename(tmp, final)
        fsync_path(root)
        atomic_write(root / "latest", final.name + "\n", durable=True)
        if keep_last:
            prune_checkpoints(root, keep_last)
    _barrier()
    return final


def _chunk_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _model_sharded_sd(chunks: Sequence[torch.nn.Module], keep=None) -> dict:
    """Each chunk's sharded state dict, with only the keys ``keep(key)`` accepts (all: None)."""
    n = len(chunks)
    return {
        _chunk_key(i, n): {
            k: v for k, v in _unwrap(c).sharded_state_dict().items() if keep is None or keep(k)
        }
        for i, c in enumerate(chunks)
    }


def _load_subset(chunk, loaded: dict, path) -> None:
    """Copy the tensors of ``loaded`` (a filtered sharded state dict) into ``chunk``'s tensors
    of the same state-dict keys (LoRA-wrapped linears keep their base keys in ``state_dict``
    but not in ``load_state_dict``, so the copy goes by the former)."""
    live = chunk.state_dict(keep_vars=True)
    absent = sorted(k for k, v in loaded.items() if torch.is_tensor(v) and k not in live)
    if absent:
        raise CheckpointError(
            f"{path}: {len(absent)} saved keys match no parameter, e.g. {absent[:3]}"
        )
    with torch.no_grad():
        for k, v in loaded.items():
            if torch.is_tensor(v):
                live[k].copy_(v)


def _unwrap(m):
    """The GPTModel inside DDP / Float16Module wrappers (their keys carry a module. prefix)."""
    while hasattr(m, "module"):
        m = m.module
    return m


def _layout() -> Dict[str, int]:
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return {"world": 1, "tp": 1, "pp": 1, "dp": 1, "ep": 1}
    layout = {
        "world": dist.get_world_size() if dist.is_initialized() else 1,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    }
    etp = ps.get_expert_tensor_parallel_world_size()
    if etp != layout["tp"]:  # the experts' own TP (MoE parallel folding); else as before
        layout["etp"] = etp
    return layout


def _rng_state() -> dict:
    from megatron.core import tensor_parallel

    state = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    from megatron.core import tensor_parallel

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded(state: Optional[dict]):
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    ws = dist.get_world_size() if dist.is_initialized() else 1
    return ShardedObject("rng_state", state, (ws,), (_rank(),), replica_id=0)


def save_checkpoint(
    root,
    iteration: int,
    model: Sequence[torch.nn.Module],
    optimizer=None,
    lr_scheduler=None,
    *,
    extra: Optional[dict] = None,
    keep_last: Optional[int] = None,
    hf_dir=None,
    save_rng: bool = True,
    model_keys=None,
) -> Path:
    """Save model chunks (+ optimizer, LR scheduler, RNG, ``extra``) as ``<root>/iter_N``.

    Collective over all ranks. ``model``: this rank's chunks (``MegatronEngine.model``);
    ``optimizer``: a megatron-core optimizer (regular: megatron's own sharded format;
    distributed: our model-space format, :mod:`~areal_mega.checkpoint.distopt_state`, because
    megatron-core 0.16.1's own formats fail on CPU); ``extra``: JSON-able trainer state
    (version, data position, ...);
    ``hf_dir``: an HF directory whose config/tokenizer files are kept for HF export;
    ``keep_last``: prune older complete checkpoints afterwards; ``model_keys``: save only the
    model keys it accepts (a LoRA run: the adapters)."""
    if extra is not None:
        json.dumps(extra)  # fail early, on every rank, if it is not JSON-able
    bad = nonfinite_parameters([_unwrap(c) for c in model])
    if bad:
        raise NonFiniteWeightsError(
            f"refusing to save {iter_dir_name(iteration)} under {root}: "
            f"{bad} holds NaN/inf values; the previous checkpoint "
            "is kept"
        )
    state = _model_sharded_sd(model, model_keys)
    opt_format = None
    if optimizer is not None:
        if distributed_optimizers(optimizer):
            opt_format = DISTOPT_FORMAT
            state["optimizer"] = {
                "distopt": distopt_sharded_state(
                    optimizer, model, list(state.values()), is_loading=False
                )
            }
        else:
            opt_format = "megatron"
            state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False)
    if lr_scheduler is not None:
        state["lr_scheduler"] = lr_scheduler.state_dict()
    if save_rng:
        state["rng_state"] = _rng_sharded(_rng_state())
    meta = {
        "layout": _layout(),
        "extra": extra or {},
        "has_optimizer": optimizer is not None,
        "optimizer_format": opt_format,
        "has_lr_scheduler": lr_scheduler is not None,
        "has_rng": save_rng,
        "num_chunks": len(model),
    }
    return atomic_save_sharded(
        root, iteration, state, meta=meta, hf_dir=hf_dir, keep_last=keep_last
    )


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------


def load_checkpoint(
    path,
    model: Sequence[torch.nn.Module],
    optimizer=None,
    lr_scheduler=None,
    *,
    load_optimizer: bool = True,
    load_rng: bool = True,
    strict: bool = True,
    model_keys=None,
) -> LoadedCheckpoint:
    """Load a checkpoint (a root → its latest, or one ``iter_*`` directory) into this rank's
    model chunks, resharding to the current TP/PP/VPP/EP layout.

    Optimizer and LR-scheduler states are loaded when present and asked for (a converted
    HF checkpoint has the model only). RNG states are restored only when the saved layout
    equals the current one. Collective over all ranks. Every file is checked against its
    recorded size and checksum first (each rank hashing a share; skipped for the path
    :func:`latest_verified` just returned). Raises :class:`CheckpointError` for a missing,
    incomplete or corrupt checkpoint, naming the file. ``model_keys``: load only the model keys
    it accepts (a LoRA model: the base weights from a converted checkpoint, or the adapters from
    a LoRA checkpoint); the other parameters keep their values. An ``optimizer`` whose state is
    not loaded (``load_optimizer=False``, or none saved) takes the loaded weights as its main
    parameters (megatron's ``reload_model_params``)."""
    from megatron.core import dist_checkpointing

    path = _resolve(path)
    just = str(path) in _JUST_VERIFIED  # latest_verified hashed it a moment ago
    _JUST_VERIFIED.discard(str(path))
    meta = read_meta(path) if all(gather_all(just)) else verify_collective(path)
    n = len(model)
    # the sharded keys are global (layer offsets, expert offsets); the chunk nesting is not
    state: Dict[str, Any] = _model_sharded_sd(model, model_keys)
    want_opt = optimizer is not None and load_optimizer and meta.get("has_optimizer")
    distopt = want_opt and meta.get("optimizer_format") == DISTOPT_FORMAT
    # saved by the other kind of optimizer (use_distributed_optimizer switched): loaded by key
    switched = want_opt and bool(distributed_optimizers(optimizer)) != distopt
    chunk_sds = [state[k] for k in list(state)]
    if switched and distopt:
        state["optimizer"] = {"switch": distributed_state_for_regular(optimizer, model, chunk_sds)}
    elif switched:
        state["optimizer"] = {"switch": regular_state_for_distributed(optimizer, model, chunk_sds)}
    elif distopt:
        state["optimizer"] = {
            "distopt": distopt_sharded_state(optimizer, model, chunk_sds, is_loading=True)
        }
    elif want_opt:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True)
    same_layout = meta.get("layout", {}) == _layout()
    want_rng = load_rng and meta.get("has_rng") and same_layout
    if want_rng:
        state["rng_state"] = _rng_sharded(None)
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: loading failed: {type(e).__name__}: {e}") from e
    for i, c in enumerate(model):
        key = _chunk_key(i, n)
        if model_keys is None:
            _unwrap(c).load_state_dict(loaded[key], strict=strict)
        else:
            _load_subset(_unwrap(c), loaded[key], path)
    bad = nonfinite_parameters([_unwrap(c) for c in model])
    if bad:
        raise NonFiniteWeightsError(
            f"{path}: {bad} holds NaN/inf values after loading; not "
            "resuming from non-finite weights (resume from an older "
            "checkpoint: move this iter_* directory away)"
        )
    if switched:
        saved = {k: v for k, v in loaded["optimizer"].items() if k != "switch"}
        if distopt:
            load_distributed_into_regular(optimizer, model, loaded["optimizer"]["switch"], saved)
        else:
            load_regular_into_distributed(optimizer, model, loaded["optimizer"]["switch"], saved)
        logger.info(
            "%s: optimizer state of the %s optimizer loaded into the %s one",
            path,
            "distributed" if distopt else "regular",
            "regular" if distopt else "distributed",
        )
    elif distopt:
        distopt_load_state(optimizer, model, loaded["optimizer"]["distopt"])
    elif want_opt:
        optimizer.load_state_dict(loaded["optimizer"])
    elif optimizer is not None:
        # weights loaded without optimizer state: a bf16/fp16 model's fp32 main parameters
        # copy them (else the first step writes the main params of before the load back)
        optimizer.reload_model_params()
    if lr_scheduler is not None and load_optimizer and meta.get("has_lr_scheduler"):
        common = dist_checkpointing.load_common_state_dict(str(path))
        lr_scheduler.load_state_dict(common["lr_scheduler"])
    if want_rng:
        _set_rng_state(loaded["rng_state"])
    elif load_rng and meta.get("has_rng"):
        logger.info(
            "%s: saved layout %s differs from %s; RNG states not restored",
            path,
            meta.get("layout"),
            _layout(),
        )
    return LoadedCheckpoint(
        path=path,
        iteration=int(meta.get("iteration", 0)),
        extra=meta.get("extra", {}),
        meta=meta,
        loaded_optimizer=bool(want_opt),
        loaded_rng=bool(want_rng),
    )
