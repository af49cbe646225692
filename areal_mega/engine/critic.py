"""CriticEngine: the actor's Megatron model with a scalar value head in place of the LM head.

The critic is a :class:`~areal_mega.engine.megatron_engine.MegatronEngine` (same builder, same
mesh, every layout the actor supports: TP/PP/VPP/DP/CP/EP, SP) whose last stage ends in
:class:`ValueHead` — one ``[1, H]`` weight, replicated on every TP rank — instead of the
vocabulary-parallel output layer. Its output at packed position t is V(prefix up to token t),
the value of the state in which token t+1 is generated: the same next-token layout as the
actor's logprobs and every per-token RL field. The engine's forward/backward, loss contract,
optimizer, LR schedule and checkpoints are the actor's; only the head and the per-position
output (values instead of logprobs) differ.

A vision-language model's critic (``model_type`` ``qwen2_5_vl``, ``qwen3_vl``) is the whole VL
model MegatronEngine builds (vision tower included, ``model.freeze_vision`` honoured) whose
language model's output layer is the value head: its micro-batches carry their images as the
actor's do, so the values of image samples see the images.

Initial weights: an LM checkpoint loads into the trunk (:class:`TrunkView` leaves the head
out) and the head starts fresh from ``seed``; an HF reward/value model directory whose
safetensors hold a ``score.weight`` of shape ``[1, H]`` also sets the head
(:func:`load_score_head`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from areal_mega.engine.loss_context import CPShard, compute_loss
from areal_mega.engine.megatron_engine import MegatronEngine
from areal_mega.engine.packed import slot_offsets
from areal_mega.models.builder import load_hf_config

__all__ = [
    "CriticEngine",
    "ValueHead",
    "TrunkView",
    "critic_optimizer_config",
    "load_score_head",
    "HEAD_PREFIX",
    "is_head_key",
]

#: State-dict prefix of the value head inside a ``GPTModel`` (it takes the output layer's place).
HEAD_PREFIX = "output_layer."
#: ... and inside a vision-language model, whose language model is the ``GPTModel``.
VL_HEAD_PREFIX = "language_model." + HEAD_PREFIX


def is_head_key(key: str) -> bool:
    """Whether a model chunk's state-dict key is the value head's (text or VL model)."""
    return key.startswith(HEAD_PREFIX) or key.startswith(VL_HEAD_PREFIX)


class ValueHead(torch.nn.Module):
    """``V = h · w`` for each position: ``h`` [S, B, H] (the final-norm hidden states) -> [S, B, 1].

    Replicated over TP (every TP rank holds the full weight and computes the full values, so
    its gradient is complete on each rank and needs no TP reduction). With sequence parallelism
    the hidden states arrive split along the sequence; they are gathered first, and the
    gather's backward keeps each rank's own slice of the (identical, full) input gradient.
    Called like megatron's output layer: ``head(h, weight=None, runtime_gather_output=None)``
    returns ``(values, None)``."""

    def __init__(
        self,
        hidden_size: int,
        *,
        dtype: torch.dtype,
        seed: int,
        std: float,
        sequence_parallel: bool,
        tp_group,
        device=None,
    ):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)  # same weight on every rank, any layout
        w = torch.randn(1, hidden_size, generator=gen) * std
        self.weight = torch.nn.Parameter(w.to(dtype=dtype, device=device))
        self.sequence_parallel = sequence_parallel
        self.tp_group = tp_group

    def forward(self, hidden_states, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return torch.nn.functional.linear(hidden_states, self.weight), None


class TrunkView:
    """A model chunk seen without its value head, for loading an LM checkpoint into the critic
    (the checkpoint's ``output_layer`` is a vocabulary projection, or absent when tied):
    ``sharded_state_dict()`` leaves the head out and ``load_state_dict`` requires every other
    key."""

    def __init__(self, chunk: torch.nn.Module):
        self.chunk = chunk

    def sharded_state_dict(self, *args, **kwargs) -> dict:
        sd = self.chunk.sharded_state_dict(*args, **kwargs)
        return {k: v for k, v in sd.items() if not is_head_key(k)}

    def load_state_dict(self, state_dict, strict: bool = True):
        res = self.chunk.load_state_dict(state_dict, strict=False)
        missing = [k for k in res.missing_keys if not is_head_key(k)]
        if strict and (missing or res.unexpected_keys):
            raise RuntimeError(
                f"critic trunk: missing {missing[:3]}, unexpected {res.unexpected_keys[:3]}"
            )
        return res


def critic_optimizer_config(optimizer_cfg, critic_cfg):
    """The critic's :class:`~areal_mega.config.OptimizerConfig`: the actor's Adam settings with
    the ``critic`` section's LR, schedule and gradient clip."""
    return dataclasses.replace(
        optimizer_cfg,
        lr=critic_cfg.lr,
        min_lr=critic_cfg.min_lr,
        warmup_steps=critic_cfg.lr_warmup_steps,
        lr_schedule=critic_cfg.lr_schedule,
        lr_decay_steps=critic_cfg.lr_decay_steps,
        clip_grad=critic_cfg.clip_grad,
    )


def _untied(hf_config) -> dict:
    """The HF config with untied embeddings: the critic's last stage must own its head, not
    share the input embedding as the LM head does (a VL config's ``text_config`` too)."""
    cfg = dict(load_hf_config(hf_config), tie_word_embeddings=False)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"] = dict(cfg["text_config"], tie_word_embeddings=False)
    return cfg


def _head_owner(chunk):
    """The module whose ``output_layer`` the value head replaces: the chunk (a ``GPTModel``)
    or a vision-language model's language model; None off the last pipeline stage."""
    if not getattr(chunk, "post_process", False):
        return None
    lm = getattr(chunk, "language_model", None)
    return chunk if lm is None else lm


class CriticEngine(MegatronEngine):
    """A trainable value model on ``mesh`` (see the module docstring).

    Args are :class:`MegatronEngine`'s for ``role="actor"``; ``optimizer_cfg`` is already the
    critic's (:func:`critic_optimizer_config`). ``forward_values`` returns per-token values;
    ``train_batch(mbs, loss_fn, ...)`` calls ``loss_fn(values [T] fp32, None, mb)``."""

    SHARES_PROMPT_PREFIX = False  # its values are read per packed row

    def __init__(
        self,
        model_cfg,
        *,
        hf_config,
        mesh,
        optimizer_cfg,
        seed: int = 1234,
        total_train_steps=None,
        use_distributed_optimizer=None,
    ):
        self._head_seed = seed + 7919  # fresh head independent of the trunk's init stream
        super().__init__(
            model_cfg,
            hf_config=_untied(hf_config),
            role="actor",
            mesh=mesh,
            optimizer_cfg=optimizer_cfg,
            actor_cfg=None,
            seed=seed,
            total_train_steps=total_train_steps,
            use_distributed_optimizer=use_distributed_optimizer,
        )

    def _wrap_ddp(self, chunks):
        """Swap the last stage's output layer for the value head before DDP and the optimizer
        see the parameters."""
        for c in chunks:
            owner = _head_owner(c)
            if owner is not None:
                owner.output_layer = ValueHead(
                    self.config.hidden_size,
                    dtype=self.config.params_dtype,
                    seed=self._head_seed,
                    std=self.config.init_method_std,
                    sequence_parallel=self.mesh.sequence_parallel,
                    tp_group=self.mesh.tp_group,
                    device=self.mesh.device,
                )
        return super()._wrap_ddp(chunks)

    def _prepare(self, mb: dict) -> dict:
        batch = super()._prepare(mb)
        total = batch["n_total"]
        starts, lens = slot_offsets(mb)
        in_seq = torch.zeros(total, dtype=torch.bool)
        for s, n in zip(starts.tolist(), lens.tolist()):
            in_seq[s : s + n] = True
        if batch["index"] is not None:
            in_seq = in_seq[batch["index"]]
        batch["in_seq"] = in_seq.to(self.mesh.device)
        return batch

    def _on_output(
        self,
        mb,
        batch,
        collect,
        temperature,
        return_entropy,
        loss_fn,
        denominator,
        output,
        non_loss_data=False,
    ):
        values = output.reshape(-1).float()
        values = torch.where(batch["in_seq"], values, torch.zeros_like(values))
        if collect:
            return {"logprobs": values.detach()}  # the base class gathers this key
        idx = batch["index"]
        shard = (
            None
            if idx is None
            else CPShard(self.mesh.cp_group, self.mesh.dims.cp, self.mesh.cp_rank)
        )
        return compute_loss(
            loss_fn,
            values,
            None,
            mb,
            denominator=denominator,
            valid=batch["valid"],
            index=idx,
            shard=shard,
        )

    @torch.no_grad()
    def forward_values(self, micro_batches: Sequence[dict]) -> list:
        """Per-token values (fp32 ``[T]`` on CPU, 0 on padding) of each micro-batch, on every
        rank of the model-parallel group (broadcast from the last stage, gathered over CP)."""
        return self.forward_logprobs(micro_batches)

    def head_parameter(self):
        """The value head's weight on the last stage (None elsewhere)."""
        for c in self.model_chunks():
            owner = _head_owner(c)
            head = None if owner is None else getattr(owner, "output_layer", None)
            if isinstance(head, ValueHead):
                return head.weight
        return None


def load_score_head(engine: CriticEngine, hf_dir: str) -> bool:
    """Set the value head from an HF reward/value model's ``score.weight`` ([1, H], as in
    ``*ForSequenceClassification`` with one label) when ``hf_dir``'s safetensors hold one.
    Returns whether it did (False too when ``hf_dir`` holds no safetensors). Raises
    ValueError naming the directory for a score head of another shape."""
    from areal_mega.checkpoint.safetensors_io import SafetensorsDir, SafetensorsError

    try:
        st = SafetensorsDir(hf_dir)
    except SafetensorsError:  # no weights there (e.g. a Megatron checkpoint.load start)
        return False
    if "score.weight" not in st:
        return False
    w = engine.head_parameter()
    _, shape = st.info("score.weight")
    if tuple(shape) != (1, engine.config.hidden_size):
        raise ValueError(
            f"{hf_dir}: score.weight has shape {tuple(shape)}; a value head needs "
            f"(1, {engine.config.hidden_size})"
        )
    if w is not None:
        with torch.no_grad():
            w.copy_(st.get("score.weight").to(dtype=w.dtype, device=w.device))
        if hasattr(engine.optimizer, "reload_model_params"):
            engine.optimizer.reload_model_params()
    return True
