"""Routed experts of a mixture-of-experts model: the layout, SGLang's wire encoding, and the
per-sample table the rollout side fills (routing replay, ``algorithm.routing_replay: r3``).

SGLang's format (``return_routed_experts`` in a ``/generate`` body, on a server started with
``--enable-return-routed-experts``): ``meta_info["routed_experts"]`` is the base64 of a C-order
little-endian int32 array ``[seqlen - 1, num_hidden_layers, num_experts_per_tok]`` where
``seqlen = prompt_tokens + completion_tokens``: row i holds the expert ids token i was routed to
when it was the input of a forward (prompt tokens in the prefill, each generated token but the
last in the decode step that fed it). The layer axis counts every decoder layer; a dense layer's
row stays 0. Without the server flag the key is absent.

The data plane's form (``token_extras["routed_experts"]``): ``[L, n_moe_layers, topk]``, MoE
layers only, int16 when the model has at most 32767 experts (else int32), -1 on rows no server
forwarded (at least the last token).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

ROUTED_EXPERTS = "routed_experts"
"""The ``token_extras`` name of the routes (and SGLang's ``meta_info`` key)."""
NO_ROUTE = -1
"""Expert id of a row no server forwarded."""


def _get(cfg: Any, key: str, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


@dataclass(frozen=True)
class RouteLayout:
    """Where routes live in a model: ``num_hidden_layers`` decoder layers, of which
    ``moe_layers`` (indices, ascending) route each token to ``topk`` of ``num_experts``."""

    num_hidden_layers: int
    moe_layers: tuple
    topk: int
    num_experts: int

    @property
    def n_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def dtype(self) -> np.dtype:
        """int16 when every expert id fits, else int32."""
        return np.dtype(np.int16 if self.num_experts <= np.iinfo(np.int16).max else np.int32)

    @classmethod
    def from_hf_config(cls, cfg: Any) -> Optional["RouteLayout"]:
        """The layout of an HF config (a ``PretrainedConfig`` or the ``config.json`` dict);
        None for a dense model. MoE layers follow the qwen2_moe / qwen3_moe rule (layer i is
        sparse unless in ``mlp_only_layers``, and when ``(i + 1) % decoder_sparse_step == 0``);
        models without those keys (e.g. Mixtral) route in every layer."""
        text = _get(cfg, "text_config")
        if text is not None and _get(cfg, "num_experts_per_tok") is None:
            cfg = text
        n_exp = _get(cfg, "num_experts") or _get(cfg, "num_local_experts") or 0
        topk = _get(cfg, "num_experts_per_tok") or 0
        n_layers = int(_get(cfg, "num_hidden_layers") or 0)
        if not (n_exp and topk and n_layers):
            return None
        dense = set(_get(cfg, "mlp_only_layers") or ())
        step = int(_get(cfg, "decoder_sparse_step") or 1)
        moe = tuple(i for i in range(n_layers) if i not in dense and (i + 1) % step == 0)
        return cls(n_layers, moe, int(topk), int(n_exp)) if moe else None

    @classmethod
    def from_model_path(cls, model_path: str) -> Optional["RouteLayout"]:
        """:meth:`from_hf_config` of ``<model_path>/config.json``; None when it has none."""
        path = Path(model_path) / "config.json"
        if not path.is_file():
            return None
        return cls.from_hf_config(json.loads(path.read_text()))


def encode_sglang_routes(rows: np.ndarray) -> str:
    """SGLang's ``meta_info["routed_experts"]`` for ``rows`` ``[n, num_hidden_layers, topk]``."""
    return base64.b64encode(np.ascontiguousarray(rows, dtype="<i4").tobytes()).decode("ascii")


def decode_sglang_routes(
    encoded: str, layout: RouteLayout, n_rows: Optional[int] = None
) -> np.ndarray:
    """SGLang's ``meta_info["routed_experts"]`` -> ``[rows, n_moe_layers, topk]`` of
    ``layout.dtype`` (the MoE layers' rows). ``ValueError`` when the size is not a whole number
    of rows, or not ``n_rows`` rows when given."""
    flat = np.frombuffer(base64.b64decode(encoded), dtype="<i4")
    per_row = layout.num_hidden_layers * layout.topk
    rows = flat.size // per_row
    if flat.size % per_row or (n_rows is not None and rows != n_rows):
        raise ValueError(
            f"meta_info.routed_experts: {flat.size} ids, expected "
            f"{'whole' if n_rows is None else n_rows} tokens x "
            f"{layout.num_hidden_layers} layers x top-{layout.topk}"
        )
    full = flat.reshape(rows, layout.num_hidden_layers, layout.topk)
    if len(layout.moe_layers) != layout.num_hidden_layers:
        full = full[:, list(layout.moe_layers)]
    return full.astype(layout.dtype)


class RouteTable:
    """Routes of one token sequence, keyed by position from its start.

    A server call whose input starts at this sequence's position 0 forwards positions
    ``0 .. len(input) + len(output) - 2``; the positions routed so far therefore always form a
    prefix, and :meth:`add` keeps, for each token, the route of the call that LAST forwarded
    it. A resumed call re-forwards the earlier tokens under the weights that then generate the
    rest, so its routes are the ones the server's latest logprobs were computed with: replaying
    them reproduces that forward exactly (replaying the first call's routes for the context
    would not: the tokens generated after the resume saw the re-forwarded context)."""

    def __init__(self, layout: RouteLayout):
        self.layout = layout
        self._parts: list = []
        self.n_routed = 0

    def add(self, rows: Optional[np.ndarray], start: int = 0) -> None:
        """Rows for positions ``start .. start + len(rows) - 1`` from one call, replacing what
        an earlier call gave for them (``start`` at most the positions routed so far: the
        positions routed always form a prefix)."""
        if rows is None:
            return
        if start > self.n_routed:
            raise ValueError(f"routes from position {start}, only {self.n_routed} known")
        end = start + len(rows)
        known = self.rows()
        self._parts = [part for part in (known[:start], rows, known[end:]) if len(part)]
        self.n_routed = max(end, self.n_routed)

    def rows(self) -> np.ndarray:
        """``[n_routed, n_moe_layers, topk]``."""
        lay = self.layout
        if not self._parts:
            return np.empty((0, lay.n_moe_layers, lay.topk), lay.dtype)
        if len(self._parts) > 1:
            self._parts = [np.concatenate(self._parts)]
        return self._parts[0]

    def full(self, length: int) -> np.ndarray:
        """``[length, n_moe_layers, topk]``: the routed rows, then :data:`NO_ROUTE` rows
        (the routed prefix is cut at ``length``)."""
        lay = self.layout
        out = np.full((length, lay.n_moe_layers, lay.topk), NO_ROUTE, lay.dtype)
        rows = self.rows()[:length]
        out[: len(rows)] = rows
        return out


def check_routes(traj, layout: RouteLayout) -> Optional[str]:
    """Why ``traj``'s ``token_extras.routed_experts`` does not fit ``layout`` (shape
    ``(L, n_moe_layers, topk)``, integer ids in ``[-1, num_experts)``); None when it does. With
    routing replay on every sample needs its routes: a trajectory without any is refused too
    (the trainer could not replay its tokens)."""
    arr = traj.token_extras.get(ROUTED_EXPERTS)
    want = (traj.length, layout.n_moe_layers, layout.topk)
    head = f"token_extras.{ROUTED_EXPERTS} of sample {traj.sample_id!r}"
    if arr is None:
        return (
            f"{head}: missing, expected {want} (algorithm.routing_replay is on: the "
            "rollout servers must return routes, started with "
            "--enable-return-routed-experts)"
        )
    if tuple(arr.shape) != want:
        return f"{head}: shape {tuple(arr.shape)}, expected {want} (tokens, MoE layers, top-k)"
    if arr.size and (int(arr.min()) < NO_ROUTE or int(arr.max()) >= layout.num_experts):
        return (
            f"{head}: expert ids in [{int(arr.min())}, {int(arr.max())}], expected "
            f"[-1, {layout.num_experts})"
        )
    return None


def repeated_expert(arr) -> Optional[tuple]:
    """``(token, layer, expert)`` of the first row of routes ``arr`` [L, layers, topk] that
    names one expert twice in its top-k (rows of -1, no route, excepted), else None. Such a
    row cannot be replayed: megatron's dispatch splits tokens by expert counts."""
    a = np.asarray(arr)
    if a.ndim != 3 or a.shape[-1] < 2 or not a.size:
        return None
    s = np.sort(a, axis=-1)
    dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] != NO_ROUTE)
    if not dup.any():
        return None
    t, layer, k = (int(i) for i in np.argwhere(dup)[0])
    return t, layer, int(s[t, layer, k])
