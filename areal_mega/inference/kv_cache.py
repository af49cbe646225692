"""The KV-cache state of the rollout engine's running batch, and the forward passes over it.

:class:`BatchedEngine <areal_mega.inference.decoding.BatchedEngine>` keeps its running requests
as rows ``0..B-1`` of one of these:

* :class:`StaticKVBatch` (Llama / Qwen2 / Qwen3 / Qwen3-MoE without sliding windows, Mistral
  with its window: a query sees its ``sliding_window`` most recent keys, the cache keeps all): a
  preallocated cache per layer, ``[rows, kv_heads, capacity, head_dim]``, grown by doubling.
  Row ``b`` holds its ``lens[b]`` tokens at columns ``0..lens[b]-1`` (no left padding); a
  decode step writes each row's new key/value at its own column and attends over
  ``0..max(lens)`` with the columns past each row's length masked. Grouped-query attention
  reads the cache through views (no repeat of the KV heads), so a step costs the model's own
  math plus attention over the tokens really there: no per-step copy of the whole cache (which
  ``DynamicCache`` does with ``torch.cat``, and transformers' GQA with ``repeat_kv``).
  The layers' norms, projections and MLPs are the model's own modules, so weight updates
  copied into the model are used at the next step.
* :class:`HFCacheBatch` (any other causal LM, e.g. Gemma 3 with its per-layer windows):
  transformers' ``DynamicCache``, rows merged by left-padding every layer's keys/values to the
  common length (sliding-window layers keep every key; the mask applies the window). Mamba /
  linear-attention layers (Nemotron-H) keep per-row states instead (:class:`RowStates`: a
  convolution window and a recurrent state, no sequence axis), joined row by row; a layer with
  both (Falcon-H1: a Mamba mixer beside the attention) keeps both (:class:`StatesAndKV`).
  DeepSeek-sparse-attention layers (GLM-MoE-DSA, DeepSeek-V3.2) also keep their indexer's keys,
  left-padded like the keys (:class:`KVAndIndexerKeys`).

Both answer :meth:`prefill` (equal-length prompts, logits of the last position; the static
batch also continues a cached prefix, see :mod:`areal_mega.inference.prefix_reuse`),
:meth:`append` (rows of a prefill join the batch), :meth:`decode` (one token per row),
:meth:`select` (keep some rows) and :meth:`reset`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from areal_mega.inference.cpu_linear import fused_linear
from areal_mega.inference.vl_model import is_vision_config, vl_forward_inputs
from areal_mega.models.sliding_window import (
    SLIDING_WINDOW_MODEL_TYPES,
    hf_sliding_window,
    window_visible,
)
from areal_mega.ops import decode as decode_ops

STATIC_KV_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
# dense MLPs computed as down(act(gate(x)) * up(x)); other MLPs (MoE blocks) run as modules
PLAIN_MLPS = ("LlamaMLP", "Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "MistralMLP")


def _norm(mod, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)`` for the models' RMSNorm (``weight * x / rms(x)``, computed in fp32) as one
    fused ``F.rms_norm`` call on fp32 inputs; other norms run as modules."""
    if (
        x.dtype == torch.float32
        and type(mod).__name__.endswith("RMSNorm")
        and hasattr(mod, "variance_epsilon")
    ):
        if torch.is_grad_enabled():
            return F.rms_norm(x, (x.shape[-1],), mod.weight, mod.variance_epsilon)
        return decode_ops.rms_norm(x, mod.weight, mod.variance_epsilon)
    return mod(x)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[n, q, heads, D]`` (the models' ``rotate_half`` form)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def make_kv_batch(model):
    """:class:`StaticKVBatch` where the model's architecture allows it, else
    :class:`HFCacheBatch`."""
    return StaticKVBatch(model) if kv_path_of(model.config) == "static" else HFCacheBatch(model)


def kv_path_of(cfg) -> str:
    """``"static"`` (:class:`StaticKVBatch`) or ``"hf_cache"`` (:class:`HFCacheBatch`): which
    running batch serves a model of transformers config ``cfg``. Sliding windows are honoured
    by the static batch for :data:`SLIDING_WINDOW_MODEL_TYPES` only (one window on every
    layer); other sliding-window or per-layer attention patterns use transformers' cache."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in STATIC_KV_MODEL_TYPES:
        return "hf_cache"
    if model_type in SLIDING_WINDOW_MODEL_TYPES:
        return "static"
    sliding = "sliding_attention" in (getattr(cfg, "layer_types", None) or ())
    return "hf_cache" if sliding or getattr(cfg, "use_sliding_window", False) else "static"


def _grown(n: int, minimum: int) -> int:
    """The power of two >= ``n`` (at least ``minimum``)."""
    cap = minimum
    while cap < n:
        cap *= 2
    return cap


class StaticKVBatch:
    """Running rows with a preallocated per-layer KV cache (see the module docstring)."""

    def __init__(self, model):
        self.model = model
        self.body = model.model
        self.layers = list(self.body.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.groups = attn.num_key_value_groups
        self.scaling = attn.scaling
        self.kv_heads = model.config.num_key_value_heads
        self.q_heads = self.kv_heads * self.groups
        cfg = model.config
        self.window = hf_sliding_window(
            {"model_type": cfg.model_type, "sliding_window": getattr(cfg, "sliding_window", None)}
        )
        self.reset()

    def reset(self) -> None:
        """Drop every row and free the cache."""
        self.k: list = []
        self.v: list = []
        self.lens = torch.zeros(0, dtype=torch.long)

    @property
    def rows(self) -> int:
        return int(self.lens.numel())

    def _cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype: the model's, but fp32 for a bf16 or fp16 model where the C++
        decode attention (fp32 only) is built. The cache then holds the model's keys and
        values exactly, and one query per row attends over them in the kernel, in fp32 (as
        the trainer attends short queries on fp32 copies), instead of torch's half-precision
        batched matmuls of a few rows: on a 2-core Intel Xeon with AMX those took a quarter
        of a bf16 server's decode time. The price is twice the cache's memory."""
        dtype = next(self.model.parameters()).dtype
        if dtype in (torch.bfloat16, torch.float16) and decode_ops.panel_kernels() is not None:
            return torch.float32
        return dtype

    def _reserve(self, rows: int, length: int) -> None:
        """Make the cache hold ``rows`` rows of ``length`` tokens, keeping what it holds."""
        have_rows = self.k[0].shape[0] if self.k else 0
        have_len = self.k[0].shape[2] if self.k else 0
        if rows <= have_rows and length <= have_len:
            return
        new_rows, new_len = _grown(rows, max(have_rows, 4)), _grown(length, max(have_len, 64))
        shape = (new_rows, self.kv_heads, new_len, self.head_dim)
        old_k, old_v, B = self.k, self.v, self.rows
        dtype = self._cache_dtype()
        self.k = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in self.layers]
        for i in range(len(old_k)):
            self.k[i][:B, :, :have_len] = old_k[i][:B]
            self.v[i][:B, :, :have_len] = old_v[i][:B]

    def _qkv(self, layer, h, rot):
        """Queries ``[n, H, q, D]`` and keys/values ``[n, Hkv, q, D]`` of hidden ``h``
        ``[n, q, hidden]``, rotary ``rot = (cos, sin)`` (``[n, q, 1, D]``, see :meth:`_rotary_of`)
        applied: one matmul for q, k and v
        (:func:`~areal_mega.inference.cpu_linear.fused_linear`)."""
        attn = layer.self_attn
        n, q, _ = h.shape
        H, Hkv = self.q_heads, self.kv_heads
        qkv = fused_linear(
            _norm(layer.input_layernorm, h), (attn.q_proj, attn.k_proj, attn.v_proj)
        ).view(n, q, H + 2 * Hkv, -1)
        cos, sin = rot
        if hasattr(attn, "q_norm"):
            qs, ks, vs = qkv.split([H, Hkv, Hkv], dim=2)
            qs = _rotary(_norm(attn.q_norm, qs), cos, sin)
            ks = _rotary(_norm(attn.k_norm, ks), cos, sin)
        else:  # rotate q and k together
            qk, vs = qkv.split([H + Hkv, Hkv], dim=2)
            qs, ks = _rotary(qk, cos, sin).split([H, Hkv], dim=2)
        return qs.transpose(1, 2), ks.transpose(1, 2), vs.transpose(1, 2)

    def _rotary_of(self, h: torch.Tensor, pos: torch.Tensor) -> tuple:
        """The model's rotary ``(cos, sin)`` at positions ``pos``, shaped ``[n, q, 1, D]`` to
        broadcast over the heads of every layer's ``[n, q, heads, D]`` projections."""
        return tuple(t.unsqueeze(2) for t in self.body.rotary_emb(h, position_ids=pos))

    def _finish_layer(self, layer, residual, attn_out):
        """Output projection, residual, MLP (gate and up in one matmul), residual."""
        h = residual + layer.self_attn.o_proj(attn_out)
        x = _norm(layer.post_attention_layernorm, h)
        mlp = layer.mlp
        if type(mlp).__name__ in PLAIN_MLPS:
            gate, up = fused_linear(x, (mlp.gate_proj, mlp.up_proj)).chunk(2, dim=-1)
            return h + mlp.down_proj(mlp.act_fn(gate) * up)
        return h + mlp(x)

    def _logits(self, h_last: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(_norm(self.body.norm, h_last)).float()

    def prefill(self, ids: torch.Tensor, prefix=None):
        """Forward prompts ``ids`` ``[n, S]`` (equal lengths); returns the last position's
        logits ``[n, V]`` and the rows' keys/values (for :meth:`append`). ``prefix``: the
        cached keys/values of ``P`` tokens before ``ids`` (common to the rows), as
        :meth:`split_payload` gives them; ``ids`` then sit at positions ``P..P+S-1`` and the
        returned keys/values cover all ``P + S`` tokens."""
        n, S = ids.shape
        P = 0 if prefix is None else prefix[0][0].shape[2]
        pos = torch.arange(P, P + S).view(1, S).expand(n, S)
        # query i (position P + i) sees keys 0..P + i (and only the last `window` of them)
        mask = None
        if self.window is not None and P + S > self.window:
            mask = window_visible(torch.arange(P, P + S), torch.arange(P + S), self.window)
        elif P and S > 1:
            mask = torch.ones(S, P + S, dtype=torch.bool).tril(P)
        h = self.body.embed_tokens(ids)
        rot = self._rotary_of(h, pos)
        kv = []
        for i, layer in enumerate(self.layers):
            qs, ks, vs = self._qkv(layer, h, rot)
            if P:
                pk, pv = prefix[i]
                ks = torch.cat([pk.expand(n, -1, -1, -1), ks], dim=2)
                vs = torch.cat([pv.expand(n, -1, -1, -1), vs], dim=2)
            kv.append((ks, vs))
            out = F.scaled_dot_product_attention(
                qs,
                ks.repeat_interleave(self.groups, 1),
                vs.repeat_interleave(self.groups, 1),
                attn_mask=mask,
                is_causal=mask is None and not P,
                scale=self.scaling,
            )
            h = self._finish_layer(layer, h, out.transpose(1, 2).reshape(n, S, -1))
        return self._logits(h[:, -1]), kv

    # the prefix cache's payload: [layers, 2 (keys, values), kv_heads, tokens, head_dim]
    KV_TOKEN_DIM = 3

    @staticmethod
    def payload_of_prefill(kv: list, row: int, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of row ``row`` of a :meth:`prefill`'s keys/values, in the
        prefix cache's layout."""
        return torch.stack(
            [torch.stack([k[row, :, start:end], v[row, :, start:end]]) for k, v in kv]
        )

    def payload_of_row(self, row: int, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of running row ``row``, in the prefix cache's layout (in
        the model's dtype, as :meth:`prefill` gives them)."""
        dtype = next(self.model.parameters()).dtype
        return torch.stack(
            [
                torch.stack([k[row, :, start:end], v[row, :, start:end]])
                for k, v in zip(self.k, self.v)
            ]
        ).to(dtype)

    @staticmethod
    def split_payload(payload: torch.Tensor) -> list:
        """A cached prefix's payload as :meth:`prefill`'s ``prefix`` (per layer ``(keys,
        values)``, ``[1, kv_heads, P, head_dim]``)."""
        return [(layer[0].unsqueeze(0), layer[1].unsqueeze(0)) for layer in payload]

    def row_len(self, row: int) -> int:
        """Tokens held by running row ``row``."""
        return int(self.lens[row])

    def append(self, kv: list, keep: list) -> None:
        """Add rows ``keep`` of a :meth:`prefill`'s keys/values at the end of the batch."""
        idx = torch.tensor(keep, dtype=torch.long)
        L = kv[0][0].shape[2]
        B, n = self.rows, len(keep)
        self._reserve(B + n, L + 1)
        for i, (ks, vs) in enumerate(kv):
            self.k[i][B : B + n, :, :L] = ks.index_select(0, idx)
            self.v[i][B : B + n, :, :L] = vs.index_select(0, idx)
        self.lens = torch.cat([self.lens, torch.full((n,), L, dtype=torch.long)])

    def decode(self, last_tokens: list) -> torch.Tensor:
        """One step: feed each row its last token; returns logits ``[B, V]``."""
        B = self.rows
        self._reserve(B, int(self.lens.max()) + 1)
        pos = self.lens.view(B, 1)
        h = self.body.embed_tokens(torch.tensor(last_tokens, dtype=torch.long).view(B, 1))
        rot = self._rotary_of(h, pos)
        for i, layer in enumerate(self.layers):
            qs, ks, vs = self._qkv(layer, h, rot)
            # each row's new key / value goes to its column lens[b]; its query attends to
            # columns 0..lens[b] (with a window, the last `window` of them)
            cache = self.k[i].dtype
            out = decode_ops.decode_attention(
                qs[:, :, 0].to(cache),
                ks[:, :, 0].to(cache),
                vs[:, :, 0].to(cache),
                self.k[i],
                self.v[i],
                self.lens,
                self.scaling,
                self.window or 0,
            )
            h = self._finish_layer(layer, h, out.to(h.dtype).reshape(B, 1, -1))
        self.lens = self.lens + 1
        return self._logits(h[:, -1])

    def select(self, keep: list) -> None:
        """Keep rows ``keep`` (in that order) as rows ``0..len(keep)-1``."""
        if not keep:
            self.reset()
            return
        if keep == list(range(len(keep))):
            self.lens = self.lens[: len(keep)].clone()
            return
        idx = torch.tensor(keep, dtype=torch.long)
        Lm = int(self.lens.max())
        for kc, vc in zip(self.k, self.v):
            kc[: len(keep), :, :Lm] = kc[idx, :, :Lm]
            vc[: len(keep), :, :Lm] = vc[idx, :, :Lm]
        self.lens = self.lens.index_select(0, idx)


class HFCacheBatch:
    """Running rows in transformers' ``DynamicCache``, merged by left padding."""

    def __init__(self, model):
        self.model = model
        self.config = model.config
        # a vision-language model: prompts may carry images, and every forward gets explicit
        # (multimodal) positions, see areal_mega.inference.vl_model
        self.vision = is_vision_config(model.config)
        self.reset()

    def reset(self) -> None:
        """Drop every row."""
        self._kv: list = []  # per layer (keys [B,H,L,D], values [B,H,L,D]) or RowStates
        self._prefill_len = 0  # the prompt length of the last prefill (its rows' length)
        self._prefill_next: list = []  # the next position of each row of the last prefill
        self._mask = None  # [B, L] long, 1 = real token
        self._next_pos: list = []

    @property
    def rows(self) -> int:
        return len(self._next_pos)

    def _forward(self, input_ids, past, attention_mask=None, position_ids=None, **extra):
        cache = _cache_keeping_every_key(self.config, past)
        out = self.model(
            input_ids=input_ids,
            past_key_values=cache,
            use_cache=True,
            attention_mask=attention_mask,
            position_ids=position_ids,
            logits_to_keep=1,
            **extra,
        )
        kv = [_layer_entry(layer) for layer in out.past_key_values.layers]
        return out.logits[:, -1, :].float(), kv

    def prefill(self, ids: torch.Tensor, prefix=None, images=None):
        """See :meth:`StaticKVBatch.prefill` (no ``prefix``: this batch keeps no prefix
        cache). ``images``: a vision-language model's
        :class:`~areal_mega.inference.vl_model.PromptImages` per row (None: a row without)."""
        if prefix is not None:
            raise ValueError("HFCacheBatch has no prefix cache")
        self._prefill_len = ids.shape[1]
        if not self.vision:
            if images is not None and any(im is not None for im in images):
                raise ValueError("images given to a model without a vision encoder")
            self._prefill_next = [ids.shape[1]] * ids.shape[0]
            return self._forward(ids, None)
        kwargs, self._prefill_next = vl_forward_inputs(
            self.model, ids, images or [None] * ids.shape[0]
        )
        return self._forward(past=None, **kwargs)

    def append(self, kv: list, keep: list) -> None:
        """See :meth:`StaticKVBatch.append` (``kv``: the last :meth:`prefill`'s)."""
        idx = torch.tensor(keep, dtype=torch.long)
        kv = [_take(e, idx) for e in kv]
        n, L = len(keep), self._prefill_len
        if not self.rows:
            self._kv, self._mask = kv, torch.ones(n, L, dtype=torch.long)
        else:
            Lb = self._mask.shape[1]
            Lm = max(Lb, L)
            self._kv = [_join(old, new, Lm) for old, new in zip(self._kv, kv)]
            mb = F.pad(self._mask, (Lm - Lb, 0))
            mn = F.pad(torch.ones(n, L, dtype=torch.long), (Lm - L, 0))
            self._mask = torch.cat([mb, mn])
        self._next_pos += [self._prefill_next[i] for i in keep]

    def decode(self, last_tokens: list) -> torch.Tensor:
        """See :meth:`StaticKVBatch.decode`."""
        B = self.rows
        ids = torch.tensor(last_tokens, dtype=torch.long).view(B, 1)
        pos = torch.tensor(self._next_pos, dtype=torch.long).view(B, 1)
        mask = torch.cat([self._mask, torch.ones(B, 1, dtype=torch.long)], dim=1)
        attention_mask = mask
        if any(isinstance(e, KVAndIndexerKeys) for e in self._kv):
            attention_mask = _step_additive_mask(mask, self.model.dtype)
        logits, self._kv = self._forward(
            ids, self._kv, attention_mask=attention_mask, position_ids=pos
        )
        self._mask = mask
        self._next_pos = [p + 1 for p in self._next_pos]
        return logits

    def select(self, keep: list) -> None:
        """Keep rows ``keep``; drop leading columns that are padding everywhere."""
        if not keep:
            self.reset()
            return
        idx = torch.tensor(keep, dtype=torch.long)
        mask = self._mask.index_select(0, idx)
        first = int((mask.sum(0) > 0).nonzero()[0]) if mask.numel() else 0
        self._mask = mask[:, first:]
        self._kv = [_take(e, idx, first) for e in self._kv]
        self._next_pos = [self._next_pos[i] for i in keep]


def _step_additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A one-token step's ``[B, 1, 1, L]`` additive mask (0 at a real token, ``dtype``'s
    minimum at padding) of ``mask`` ``[B, L]`` (1 = real token), which transformers uses as
    given. A sparse-attention model needs it: under SDPA transformers (5.12) makes a 2D mask a
    boolean one, which the DSA indexer adds to its scores (+1 / +0: padding stays selectable)
    and into which the attention writes ``finfo.min`` at the keys outside the top-k (``True``:
    every key attended, the sparsity lost)."""
    return (1 - mask[:, None, None, :]).to(dtype) * torch.finfo(dtype).min


def _cache_keeping_every_key(config, past):
    """transformers' ``DynamicCache`` for a model of ``config`` holding ``past`` (per layer
    ``(keys, values)``; None: empty), except that sliding-window layers keep every key like
    full-attention ones. The rows are merged by left padding every layer to one common length
    (the attention mask's), which a sliding layer's cache (its last ``window - 1`` keys only,
    e.g. Gemma 3's) breaks; the window itself is applied by transformers' sliding mask, which
    counts cache columns, and left padding leaves a row's real tokens contiguous."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    cache.layers = [
        DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
        for layer in cache.layers
    ]
    past = past or ()
    if len(cache.layers) < len(past) and cache.layer_class_to_replicate is not None:
        # a cache of lazily made layers, which zip() below would not fill: transformers
        # 5.12 makes one for Gemma 4 without key/value-shared layers (its layer list cut at
        # [:-num_kv_shared_layers], i.e. [:-0], is empty)
        cache.layers += [
            cache.layer_class_to_replicate() for _ in range(len(past) - len(cache.layers))
        ]
    for layer, entry in zip(cache.layers, past):
        if isinstance(entry, KVAndIndexerKeys):
            if entry.kv[0] is not None:
                layer.update(*entry.kv)
            if entry.indexer_keys is not None:
                layer.update_indexer(entry.indexer_keys)
        elif isinstance(entry, StatesAndKV):
            _restore(layer, entry.states)
            if entry.kv[0] is not None:
                layer.update(*entry.kv)
        elif isinstance(entry, RowStates):
            _restore(layer, entry)
        elif entry[0] is not None:
            layer.update(*entry)
    return cache


def _restore(layer, entry) -> None:
    """A cache layer's convolution / recurrent states from ``entry`` (:class:`RowStates`;
    sets ``has_previous_state``: the model then decodes a step)."""
    if entry.conv is not None:
        layer.update_conv_state(entry.conv)
    if entry.recurrent is not None:
        layer.update_recurrent_state(entry.recurrent)


class RowStates(NamedTuple):
    """A Mamba / linear-attention layer's cache entry: each row's convolution window and
    recurrent state (leading axis: rows; None where the layer keeps none)."""

    conv: Optional[torch.Tensor]
    recurrent: Optional[torch.Tensor]


class StatesAndKV(NamedTuple):
    """The cache entry of a layer with a Mamba mixer beside its attention (Falcon-H1): the
    mixer's :class:`RowStates` and the attention's ``(keys, values)``."""

    states: RowStates
    kv: tuple


class KVAndIndexerKeys(NamedTuple):
    """The cache entry of a DeepSeek-sparse-attention layer (GLM-MoE-DSA, DeepSeek-V3.2): the
    attention's ``(keys, values)`` and its indexer's keys ``[B, L, D]`` (None on a layer that
    reuses the previous layer's top-k and runs no indexer)."""

    kv: tuple
    indexer_keys: Optional[torch.Tensor]


def _layer_entry(layer):
    """One layer of transformers' cache as this batch keeps it: :class:`RowStates` for a
    linear-attention layer, :class:`StatesAndKV` for a layer with both,
    :class:`KVAndIndexerKeys` for a sparse-attention layer, else ``(keys, values)`` (None, None
    for a layer without attention, e.g. Nemotron-H's MLP layers)."""
    from transformers.cache_utils import (
        DynamicIndexedLayer,
        DynamicLayer,
        LinearAttentionCacheLayerMixin,
    )

    kv = (getattr(layer, "keys", None), getattr(layer, "values", None))
    if isinstance(layer, DynamicIndexedLayer):
        return KVAndIndexerKeys(kv, layer.indexer_keys)
    if isinstance(layer, LinearAttentionCacheLayerMixin):
        states = RowStates(layer.conv_states, layer.recurrent_states)
        return StatesAndKV(states, kv) if isinstance(layer, DynamicLayer) else states
    return kv


def _take(entry, idx: torch.Tensor, first: int = 0):
    """Rows ``idx`` of a layer entry (keys / values / indexer keys from column ``first`` on)."""
    if isinstance(entry, KVAndIndexerKeys):
        ik = entry.indexer_keys
        ik = None if ik is None else ik.index_select(0, idx)[:, first:]
        return KVAndIndexerKeys(_take(entry.kv, idx, first), ik)
    if isinstance(entry, StatesAndKV):
        return StatesAndKV(_take(entry.states, idx), _take(entry.kv, idx, first))
    if isinstance(entry, RowStates):
        return RowStates(*(None if t is None else t.index_select(0, idx) for t in entry))
    return tuple(None if t is None else t.index_select(0, idx)[:, :, first:] for t in entry)


def _join(old, new, length: int):
    """A layer entry of the batch's rows followed by another's, keys / values / indexer keys
    left-padded to ``length``."""
    if isinstance(old, KVAndIndexerKeys):
        a, b = old.indexer_keys, new.indexer_keys
        ik = None if a is None else torch.cat([_lpad(a, length), _lpad(b, length)])
        return KVAndIndexerKeys(_join(old.kv, new.kv, length), ik)
    if isinstance(old, StatesAndKV):
        return StatesAndKV(_join(old.states, new.states, length), _join(old.kv, new.kv, length))
    if isinstance(old, RowStates):
        return RowStates(*(None if a is None else torch.cat([a, b]) for a, b in zip(old, new)))
    return tuple(
        None if a is None else torch.cat([_lpad(a, length), _lpad(b, length)])
        for a, b in zip(old, new)
    )


def _lpad(t: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad a ``[B, H, L, D]`` (or indexer keys' ``[B, L, D]``) cache tensor with zeros
    along L to ``length``."""
    return F.pad(t, (0, 0, length - t.shape[-2], 0)) if t.shape[-2] < length else t
