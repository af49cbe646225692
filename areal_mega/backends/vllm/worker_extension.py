"""Our extension of vLLM's workers: the receiving side of the trainer's weight broadcast.

vLLM loads it with ``--worker-extension-cls``
``areal_mega.backends.vllm.worker_extension.WeightSyncExtension`` (the launcher puts this
package on the vLLM process's ``PYTHONPATH``), mixing the class into each worker; the rollout
client calls its methods through vLLM's dev-mode ``/collective_rpc``
(:class:`~areal_mega.backends.vllm.client.VLLMClient`). It runs in vLLM's own environment, so it
imports nothing of areal_mega, and torch and vLLM only inside the methods.

The group is vLLM's ``stateless_init_torch_distributed_process_group`` (gloo on CPU, NCCL on
GPU); the trainer's rank 0 meets it with ``init_update_group(..., handshake="vllm")``. Each
worker joins as rank ``rank_offset + its tensor-parallel rank`` and receives every tensor whole
(root 0 broadcasts them one by one in the listed order, as to SGLang); vLLM's own loader
shards them. The buckets of one version are kept until ``areal_apply_weights`` (after the last),
then loaded in one ``model_runner.reload_weights(weights_iterator=...)``: vLLM's in-place
reload processes a layer once all of its weights have arrived, so a layer split over two
buckets must not be loaded half.

Arguments come as one JSON string (``/collective_rpc`` passes strings), answers are JSON-able.
"""

from __future__ import annotations

import json

__all__ = ["WeightSyncExtension"]

_DTYPES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
)


def _spec(spec, *keys) -> dict:
    d = json.loads(spec) if isinstance(spec, str) else dict(spec)
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(f"areal weight sync: missing {missing} in {sorted(d)}")
    return d


class WeightSyncExtension:
    """Methods mixed into vLLM's worker (``self`` is the worker: ``model_runner``, ``device``)."""

    def areal_join_weight_group(self, spec) -> dict:
        """Join the trainer's group: ``spec`` has master_address, master_port, rank_offset,
        world_size, backend (gloo | nccl) and timeout_s. Blocks until every rank has joined.
        A group held from before is left first."""
        import datetime

        import torch
        from vllm.distributed.parallel_state import get_tp_group
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        d = _spec(spec, "master_address", "master_port", "rank_offset", "world_size", "backend")
        if d["backend"] not in ("gloo", "nccl"):
            raise ValueError(f"backend={d['backend']!r}: must be gloo or nccl")
        self.areal_leave_weight_group("{}")
        rank = int(d["rank_offset"]) + get_tp_group().rank_in_group
        self._areal_group = stateless_init_torch_distributed_process_group(
            d["master_address"],
            int(d["master_port"]),
            rank,
            int(d["world_size"]),
            d["backend"],
            timeout=datetime.timedelta(seconds=float(d.get("timeout_s", 300))),
        )
        self._areal_pending = []
        self._areal_device = torch.device("cpu") if d["backend"] == "gloo" else self.device
        return {"rank": rank}

    def areal_receive_weights(self, spec) -> dict:
        """Receive one bucket (``names``, ``dtypes``, ``shapes``) broadcast from rank 0; with
        ``apply`` (default true) load every bucket received since the last load."""
        import torch

        d = _spec(spec, "names", "dtypes", "shapes")
        group = getattr(self, "_areal_group", None)
        if group is None:
            raise RuntimeError("areal_receive_weights: no weight-update group (join first)")
        if not len(d["names"]) == len(d["dtypes"]) == len(d["shapes"]):
            raise ValueError("areal_receive_weights: names, dtypes and shapes differ in length")
        bad = [t for t in d["dtypes"] if t not in _DTYPES]
        if bad:
            raise ValueError(f"areal_receive_weights: unknown dtypes {bad}")
        for name, dtype, shape in zip(d["names"], d["dtypes"], d["shapes"]):
            t = torch.empty(
                [int(x) for x in shape], dtype=getattr(torch, dtype), device=self._areal_device
            )
            group.broadcast(t, 0).wait()
            self._areal_pending.append((name, t))
        loaded = 0
        if d.get("apply", True):
            loaded = self._areal_apply()
        return {"received": len(d["names"]), "loaded": loaded}

    def areal_apply_weights(self, spec="{}") -> dict:
        """Load every bucket received since the last load."""
        return {"loaded": self._areal_apply()}

    def areal_reload_from_disk(self, spec) -> dict:
        """Load the HF checkpoint directory ``model_path`` in place."""
        d = _spec(spec, "model_path")
        self.model_runner.reload_weights(
            weights_path=str(d["model_path"]), is_checkpoint_format=True
        )
        return {"repacked": self._areal_repack_kept_weights()}

    def _areal_apply(self) -> int:
        pending, self._areal_pending = getattr(self, "_areal_pending", []), []
        if pending:
            self.model_runner.reload_weights(
                weights_iterator=iter(pending), is_checkpoint_format=True
            )
            self._areal_repack_kept_weights()
        return len(pending)

    def _areal_repack_kept_weights(self) -> int:
        """vLLM's CPU linears compute from a copy of their weight packed at load time. The
        in-place reload repacks every layer it loads, but not a layer that loads nothing of
        its own: a tied LM head (its weight is the embedding's, updated in place) kept the old
        packed copy and the logits came from the old weights. Layers that kept their weight
        (the packers of linears drop theirs) are packed again from it."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return 0
        n = 0
        for module in self.model_runner.get_model().modules():
            weight = getattr(module, "weight", None)
            method = getattr(module, "quant_method", None)
            if (
                hasattr(module, "cpu_linear")
                and method is not None
                and weight is not None
                and weight.numel() > 0
            ):
                method.process_weights_after_loading(module)
                n += 1
        return n

    def areal_leave_weight_group(self, spec="{}") -> dict:
        """Leave the group (if any) and drop buckets not yet loaded."""
        from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

        group = getattr(self, "_areal_group", None)
        self._areal_group, self._areal_pending = None, []
        if group is not None:
            stateless_destroy_torch_distributed_process_group(group)
        return {"left": group is not None}
