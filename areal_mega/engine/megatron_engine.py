"""MegatronEngine: packed forward (log-probs) and train step for actor and reference models.

The engine runs megatron-core's pipeline schedule (``get_forward_backward_func``, variable
sequence lengths) over packed micro-batches from
:func:`areal_mega.scheduler.packing.pack_sequences`. Attention stays inside each sequence
through THD ``PackedSeqParams``: TransformerEngine's kernels on GPU, per-sequence SDPA
(:mod:`areal_mega.models.varlen_attention`) on CPU or without TE. Log-probabilities come from
:func:`areal_mega.ops.packed_logprobs` on the
vocabulary-parallel logits, with the padded vocabulary ids masked out.

Loss contract (``train_batch``): on the last stage, per micro-batch, the engine calls
``loss_fn(logprobs [T] fp32, entropy [T] | None, mb) -> (numerator, stats)`` with ``mb`` on the
compute device and, under context parallelism, cut to this rank's tokens with that share's own
segment layout (see :mod:`areal_mega.engine.loss_context`); the optimised loss is
``Σ numerators / D`` where ``D = Σ_{micro-batches, DP ranks} denominator_fn(mb)`` over the full
micro-batches (default: loss-mask token count). Megatron's own loss scaling is disabled
(``calculate_per_token_loss``: the schedule neither divides by the micro-batch count nor DDP
averages over DP × CP), so gradients do not depend on the micro-batch split nor on the DP size.
A loss marked :func:`~areal_mega.algo.policy_loss.reads_loss_mask_only` (the policy and SFT
losses) gets logits computed at its ``loss_mask`` rows only (:mod:`areal_mega.engine.loss_rows`;
its log-probabilities and entropies are 0 elsewhere).

A vision-language model (``model_type`` ``qwen2_5_vl``, ``qwen3_vl``:
:mod:`areal_mega.models.vlm`) is the bridge's whole model; each micro-batch carries its
samples' images (``pixel_values``, ``image_grid_thw``, in packed order), the model computes the
multimodal positions itself, and logits are computed at every row.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from functools import partial
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from areal_mega.engine.dispatcher_graph import release_dispatcher_graphs
from areal_mega.engine.finite import blame, model_grads, nonfinite_flags
from areal_mega.engine.loss_context import CPShard, compute_loss, global_denominator, reduce_stats
from areal_mega.engine.loss_rows import logits_at_rows, loss_rows, scatter_rows
from areal_mega.engine.micro_batch import model_rows, prepare_micro_batch
from areal_mega.engine.packed import zigzag_merge
from areal_mega.engine.routing_replay import (
    RouteReplayer,
    check_replay_target,
    cleared_after,
    free_routing_if,
)
from areal_mega.lora.targets import check_vision_language_lora
from areal_mega.models.backend import resolve_attention
from areal_mega.models.builder import build_model_chunks, load_hf_config, parse_hf_config
from areal_mega.models.rope_positions import positions_supported, rope_at_positions
from areal_mega.models.vlm.builder import build_vl_model_chunks
from areal_mega.models.vlm.config import is_vl_config, vl_text_arch

__all__ = ["MegatronEngine", "default_denominator"]

LossFn = Callable[[torch.Tensor, Optional[torch.Tensor], dict], tuple]


def default_denominator(mb: dict) -> torch.Tensor:
    """Number of loss-mask tokens of a micro-batch."""
    return torch.as_tensor(mb["loss_mask"]).sum()


#: the HF config fields naming a vision-language model's vision special tokens (Qwen2-VL /
#: Qwen2.5-VL spelling), which the rollout servers never sample
VISION_TOKEN_FIELDS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "vision_token_id",
)


def vision_special_token_ids(hf_config: dict) -> list:
    """The vision special token ids of a vision-language HF config (sorted; empty for a text
    model). The rollout servers never sample them: their logits are ``-inf`` before the
    reported logprob is taken, so an RL policy's distribution leaves them out too
    (:attr:`MegatronEngine.banned_token_ids`)."""
    if not is_vl_config(hf_config):
        return []
    return sorted({int(hf_config[f]) for f in VISION_TOKEN_FIELDS if hf_config.get(f) is not None})


class MegatronEngine:
    """A megatron-core GPT model (actor: trainable; ref: forward only) on a ParallelMesh.

    Args:
        model_cfg: :class:`areal_mega.config.ModelConfig` (dtype, vocab padding, recompute).
        hf_config: path to an HF model directory / ``config.json``, or the config dict;
            defaults to ``model_cfg.path``.
        role: ``"actor"`` (DDP + optimizer + LR schedule) or ``"ref"`` (forward only, no
            optimizer state, no gradient buffers).
        mesh: the :class:`~areal_mega.parallel.mesh.ParallelMesh` (owns the process groups).
        optimizer_cfg: :class:`areal_mega.config.OptimizerConfig` (actor only).
        actor_cfg: :class:`areal_mega.config.ActorConfig` (temperature, logprob chunk size).
        seed: weight-initialisation seed.
        total_train_steps: LR schedule horizon when ``optimizer_cfg.lr_decay_steps`` is 0.
        use_distributed_optimizer: override ``optimizer_cfg.use_distributed_optimizer`` (on
            every device; its checkpoints are saved in our own reshardable format,
            :mod:`areal_mega.checkpoint.distopt_state`, as megatron's need TE).
        routing_replay: replay the rollout's MoE routes (``algorithm.routing_replay: r3``;
            actor of a MoE model only): see :mod:`areal_mega.engine.routing_replay`.
        lora: :class:`areal_mega.config.LoraConfig`; when enabled (actor only), LoRA
            adapters train on the frozen base (``self.lora``, :mod:`areal_mega.lora.actor`).

    ``shares_prompt_prefix``: micro-batches whose samples share a prompt run it once
    (``actor.share_prompt_prefix``, on by default; dense models on the local attention only,
    without linear-attention layers, not hybrid (Mamba) models, no CP nor SP); results are the
    same as without.
    """

    SHARES_PROMPT_PREFIX = True  # False where outputs are read per packed row (the critic)

    def __init__(
        self,
        model_cfg,
        *,
        hf_config=None,
        role: str = "actor",
        mesh,
        optimizer_cfg=None,
        actor_cfg=None,
        seed: int = 1234,
        total_train_steps: Optional[int] = None,
        use_distributed_optimizer: Optional[bool] = None,
        routing_replay: bool = False,
        lora=None,
    ):
        if role not in ("actor", "ref"):
            raise ValueError(f"role must be 'actor' or 'ref', got {role!r}")
        if role == "actor" and optimizer_cfg is None:
            raise ValueError("role='actor' needs optimizer_cfg")
        self.role = role
        self.mesh = mesh
        self.model_cfg = model_cfg
        self.actor_cfg = actor_cfg
        self.optimizer_cfg = optimizer_cfg
        self.hf_config = load_hf_config(hf_config if hf_config is not None else model_cfg.path)
        # a vision-language model (areal_mega/models/vlm): the bridge's whole model, whose
        # forward takes each micro-batch's images; self.arch describes its language model
        self.is_vl = is_vl_config(self.hf_config)
        self.arch = vl_text_arch(self.hf_config) if self.is_vl else parse_hf_config(self.hf_config)
        check_replay_target(routing_replay, role, self.arch)
        attn = resolve_attention(getattr(model_cfg, "attention_backend", "auto"))
        self.use_te = attn.use_te
        build = dict(
            dtype=model_cfg.dtype,
            make_vocab_size_divisible_by=model_cfg.make_vocab_size_divisible_by,
            recompute_granularity=model_cfg.recompute_granularity if role == "actor" else None,
            use_te=self.use_te,
            attention_backend=attn.backend,
            seed=seed,
        )
        if self.is_vl:
            if lora is not None and getattr(lora, "enabled", False):
                check_vision_language_lora(self.hf_config["model_type"])  # before building
            chunks, self.config = build_vl_model_chunks(
                self.hf_config,
                mesh,
                **build,
                freeze_vision=bool(getattr(model_cfg, "freeze_vision", False)),
            )
        else:
            chunks, self.config = build_model_chunks(
                self.arch, mesh, **build, moe_enable_routing_replay=routing_replay
            )
        from areal_mega.lora.actor import attach_lora

        self.lora = attach_lora(self, chunks, lora if role == "actor" else None)
        self.vocab_size = self.arch.vocab_size
        # token ids left out of every softmax (RL with a VL model: its vision special tokens,
        # which the rollout servers never sample; see vision_special_token_ids)
        self.banned_token_ids: list = []
        lm = chunks[0].language_model if self.is_vl else chunks[0]
        self.padded_vocab_size = lm.vocab_size
        self.config.calculate_per_token_loss = True
        self.optimizer = None
        self.lr_scheduler = None
        self.step_count = 0
        self.replay = RouteReplayer(chunks, mesh, self.arch) if routing_replay else None
        # shared prompts computed once (scheduler/shared_prefix.py): the local attention reads
        # the layout, the rotary table is indexed by each row's position
        self.shares_prompt_prefix = bool(
            self.SHARES_PROMPT_PREFIX
            and getattr(actor_cfg, "share_prompt_prefix", True)
            and not self.use_te
            and mesh.dims.cp == 1
            and not mesh.sequence_parallel
            and not self.arch.is_moe  # its router's load statistics count every copy
            and not self.is_vl  # the bridge's forward computes the positions itself
            # a linear-attention layer's answers continue the prompt's recurrent state, which
            # the shared prompt's attention-only layout does not carry
            and self.arch.linear_attention_layers is None
            # a Mamba layer's state runs through the whole sequence: no prefix computed apart
            and not self.arch.has_mamba
            and self.replay is None
            and all(positions_supported(c) for c in chunks)
        )
        if role == "ref":
            for c in chunks:
                c.requires_grad_(False)
                c.eval()
            self.model = chunks
        else:
            if use_distributed_optimizer is None:
                use_distributed_optimizer = optimizer_cfg.use_distributed_optimizer
            self.use_distributed_optimizer = bool(use_distributed_optimizer)
            self.model = self._wrap_ddp(chunks)
            self.optimizer = self._build_optimizer()
            self.lr_scheduler = self._build_lr_scheduler(total_train_steps)
            from megatron.core.distributed import finalize_model_grads

            from areal_mega.engine.moe_aux import moe_aux_loss_scaling

            # Loss is already divided by the global denominator: never rescale by num_tokens;
            # the MoE aux loss gets its per-token scale per step instead (engine/moe_aux.py).
            self.config.finalize_model_grads_func = lambda model, num_tokens=None, **kw: (
                finalize_model_grads(model, None, **kw)
            )
            self.moe_aux = moe_aux_loss_scaling(self)
            if self.config.fp16:
                self.config.grad_scale_func = self.optimizer.scale_loss

    # ------------------------------------------------------------------ construction
    def _wrap_ddp(self, chunks):
        from areal_mega.engine.optim import wrap_ddp

        return wrap_ddp(
            self.config, chunks, self.mesh.pg_collection, self.use_distributed_optimizer
        )

    def _build_optimizer(self):
        from areal_mega.engine.optim import build_optimizer

        return build_optimizer(
            self.optimizer_cfg,
            self.config,
            self.model,
            self.use_distributed_optimizer,
            self.mesh.pg_collection,
        )

    def _build_lr_scheduler(self, total_train_steps):
        from areal_mega.engine.optim import build_lr_scheduler

        return build_lr_scheduler(self.optimizer, self.optimizer_cfg, total_train_steps)

    # ------------------------------------------------------------------ data preparation
    def _prepare(self, mb: dict) -> dict:
        """Model inputs for one packed micro-batch (:func:`prepare_micro_batch`); its
        ``labels`` (next-token targets, -1 = none) come with it, CP-split like the tokens."""
        return prepare_micro_batch(
            mb,
            self.mesh,
            use_te=self.use_te,
            replay=self.replay,
            share_prefix=self.shares_prompt_prefix,
        )

    # ------------------------------------------------------------------ model pieces
    def _images(self, mb: dict) -> dict:
        """A vision-language micro-batch's images, on the device: ``pixel_values`` [patches,
        C·t·p·p] and ``image_grid_thw`` [images, 3] of its samples' images in packed order (None
        without images, also when the micro-batch's samples have none;
        :func:`areal_mega.models.vlm.inputs.pack_samples`,
        :func:`areal_mega.scheduler.packing.pack_images`)."""
        out = {}
        grid = mb.get("image_grid_thw")
        none = grid is None or len(grid) == 0  # a micro-batch of text samples only
        for key in ("pixel_values", "image_grid_thw"):
            x = mb.get(key)
            out[key] = None if none or x is None else torch.as_tensor(x).to(self.mesh.device)
        return out

    def _mask_padded_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Exclude padded vocabulary ids (>= HF vocab size) and a VL model's vision special
        tokens (:attr:`banned_token_ids`) from the softmax."""
        v_local = logits.shape[-1]
        start = self.mesh.tp_rank * v_local
        n_valid = self.vocab_size - start
        banned = [t - start for t in self.banned_token_ids if start <= t < start + v_local]
        if n_valid >= v_local and not banned:
            return logits
        neg = -1e4 if logits.dtype == torch.float16 else -1e9
        keep = torch.arange(v_local, device=logits.device) < max(n_valid, 0)
        if banned:
            keep[torch.tensor(banned, device=logits.device)] = False
        return logits.masked_fill(~keep, neg)

    def _token_logprobs(
        self, output: torch.Tensor, batch: dict, temperature: float, return_entropy: bool
    ):
        logits = output.reshape(-1, output.shape[-1])  # [1, T, V_local] -> [T, V_local]
        logits = self._mask_padded_vocab(logits)
        chunk = getattr(self.actor_cfg, "logprob_chunk_size", None)
        from areal_mega.ops import logits_read_by_loss_only, packed_logprobs

        rows = batch.get("rows")  # logits of these rows only (engine/loss_rows.py)
        res = packed_logprobs(
            logits,
            batch["model_labels"] if rows is None else batch["labels"][rows],
            temperature=temperature,
            tp_group=self.mesh.tp_group if self.mesh.dims.tp > 1 else None,
            chunk_size=chunk,
            return_entropy=return_entropy,
            grad_in_logits=logits_read_by_loss_only(logits),
        )
        lp, ent = res if return_entropy else (res, None)
        valid = batch["valid"]
        if rows is None and batch["expand"] is not None:  # back to the packed layout
            lp = lp.index_select(0, batch["expand"])
            ent = None if ent is None else ent.index_select(0, batch["expand"])
        if rows is not None:
            lp = scatter_rows(lp, rows, valid.shape[0])
            ent = None if ent is None else scatter_rows(ent, rows, valid.shape[0])
        lp = torch.where(valid, lp, torch.zeros_like(lp))
        if ent is not None:
            ent = torch.where(valid, ent, torch.zeros_like(ent))
        return lp, ent

    def _forward_step(
        self,
        data_iterator,
        model,
        *,
        collect,
        temperature,
        return_entropy,
        loss_fn=None,
        denominator=None,
    ):
        mb, batch = next(data_iterator)
        armed = self.replay and self.replay.arm(self.model.index(model), batch["routes"])
        batch["rows"] = (
            None
            # the bridge's VL forward and HybridModel (Nemotron-H) take no output processor:
            # the logits of every row
            if collect or self.is_vl or self.arch.hybrid_layer_pattern is not None
            else loss_rows(
                loss_fn,
                mb,
                batch["valid"],
                batch["index"],
                sequence_parallel=self.mesh.sequence_parallel,
            )
        )
        trim = (
            {}
            if batch["rows"] is None
            else dict(
                output_processor=logits_at_rows,
                output_processor_context=model_rows(batch, batch["rows"]),
            )
        )
        with (
            blame(mb),
            rope_at_positions(model, batch["position_ids"][0])
            if batch["expand"] is not None
            else nullcontext(),
        ):
            if self.is_vl:  # its own multimodal positions; the micro-batch's images
                output = model(
                    input_ids=batch["input_ids"],
                    position_ids=None,
                    attention_mask=None,
                    **self._images(mb),
                    packed_seq_params=batch["packed_seq_params"],
                )
            else:
                output = model(
                    batch["input_ids"],
                    batch["position_ids"],
                    batch["attention_mask"],
                    packed_seq_params=batch["packed_seq_params"],
                    **trim,
                )
        if armed:
            armed(output)
        return output, partial(
            self._on_output, mb, batch, collect, temperature, return_entropy, loss_fn, denominator
        )

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
        lp, ent = self._token_logprobs(output, batch, temperature, return_entropy)
        if collect:
            return {
                "logprobs": lp.detach().float(),
                "entropy": None if ent is None else ent.detach().float(),
            }
        idx = batch["index"]
        shard = (
            None
            if idx is None
            else CPShard(self.mesh.cp_group, self.mesh.dims.cp, self.mesh.cp_rank)
        )
        return compute_loss(
            loss_fn,
            lp,
            ent,
            mb,
            denominator=denominator,
            valid=batch["valid"],
            index=idx,
            shard=shard,
        )

    def _run_schedule(self, micro_batches, step_fn, forward_only: bool, collect: bool):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if len(micro_batches) % self.micro_batch_multiple:
            raise ValueError(
                f"the interleaved pipeline (virtual_pipeline_size={self.mesh.vpp}) "
                f"needs a multiple of PP={self.micro_batch_multiple} micro-batches, "
                f"got {len(micro_batches)}"
            )
        batches = []
        for mb in micro_batches:
            with blame(mb):
                batches.append(self._prepare(mb))
        data = list(zip(micro_batches, batches))
        n_chunks = len(self.model)
        iters = [iter(data) for _ in range(n_chunks)] if n_chunks > 1 else iter(data)
        seq_len = max(b["input_ids"].shape[1] for b in batches)
        fwd_bwd = get_forward_backward_func(pp_size=self.mesh.dims.pp, vp_size=self.mesh.vpp)
        try:
            with cleared_after(self.replay):
                return fwd_bwd(
                    forward_step_func=step_fn,
                    data_iterator=iters,
                    model=self.model if n_chunks > 1 else self.model[0],
                    num_microbatches=len(micro_batches),
                    seq_length=seq_len,
                    micro_batch_size=1,
                    forward_only=forward_only,
                    collect_non_loss_data=collect,
                )
        finally:
            release_dispatcher_graphs(self.model)

    @property
    def micro_batch_multiple(self) -> int:
        """Micro-batch counts the schedule accepts are multiples of this: PP under the
        interleaved schedule (megatron runs micro-batches in groups of PP per model chunk),
        else 1."""
        return self.mesh.dims.pp if self.mesh.vpp else 1

    def _set_mode(self, train: bool):
        for c in self.model:
            c.train(train)

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def forward_logprobs(
        self,
        micro_batches: Sequence[dict],
        *,
        temperature: float = 1.0,
        return_entropy: bool = False,
        free_routing: bool = False,
    ):
        """Per-token log-probability of each token's next token (the micro-batch's ``labels``,
        from ``train.batches.next_token_layout``), per micro-batch.

        Returns a list (one per micro-batch) of fp32 ``[T]`` tensors on CPU, or of
        ``(logprobs, entropy)`` pairs with ``return_entropy``. Positions with label -1 (the last
        token of each sequence, padding) get 0. Results are broadcast from the last pipeline stage
        (and gathered
        over CP), so every rank of the model-parallel group returns them. With routing replay
        the routers replay the routes, or with ``free_routing`` route freely and count the
        agreement with them (``self.replay.agreement()``)."""
        if not micro_batches:
            return []
        self._set_mode(False)
        step = partial(
            self._forward_step, collect=True, temperature=temperature, return_entropy=return_entropy
        )
        with free_routing_if(self.replay, free_routing):
            out = self._run_schedule(micro_batches, step, forward_only=True, collect=True)
        totals = [int(torch.as_tensor(mb["input_ids"]).numel()) for mb in micro_batches]
        n_fields = 2 if return_entropy else 1
        flat_len = sum(totals) * n_fields
        if self.mesh.is_last_stage:
            parts = []
            for rec, mb, total in zip(out, micro_batches, totals):
                for key in ("logprobs", "entropy")[:n_fields]:
                    parts.append(self._gather_cp(rec[key], mb, total))
            flat = torch.cat(parts).to(self.mesh.device)
        else:
            flat = torch.empty(flat_len, dtype=torch.float32, device=self.mesh.device)
        if self.mesh.dims.pp > 1:
            dist.broadcast(flat, src=self.mesh.last_stage_global_rank(), group=self.mesh.pp_group)
        flat = flat.cpu()
        res, off = [], 0
        for total in totals:
            fields = []
            for _ in range(n_fields):
                fields.append(flat[off : off + total])
                off += total
            res.append(tuple(fields) if return_entropy else fields[0])
        return res

    def _gather_cp(self, x: torch.Tensor, mb: dict, total: int) -> torch.Tensor:
        cp = self.mesh.dims.cp
        if cp == 1:
            return x
        shards = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(shards, x.contiguous(), group=self.mesh.cp_group)
        bounds = torch.as_tensor(mb.get("cu_seqlens_padded", mb["cu_seqlens"])).tolist()
        return zigzag_merge(shards, bounds, total)

    def global_denominator(
        self, micro_batches: Sequence[dict], denominator_fn: Optional[Callable] = None
    ) -> torch.Tensor:
        """Σ over micro-batches and DP ranks of ``denominator_fn(mb)`` (fp32 scalar)."""
        return global_denominator(micro_batches, denominator_fn or default_denominator, self.mesh)

    def forward_backward(
        self,
        micro_batches: Sequence[dict],
        loss_fn: LossFn,
        denominator_fn: Optional[Callable] = None,
        *,
        temperature: Optional[float] = None,
        return_entropy: bool = False,
    ) -> dict:
        """Zero the gradient buffers, run forward+backward over all micro-batches and reduce the
        gradients (DP, SP norms, tied embeddings); no optimizer step. Returns summed stats
        (reduced over DP, identical on every rank)."""
        if self.role != "actor":
            raise RuntimeError("forward_backward needs role='actor'")
        if temperature is None:
            temperature = getattr(self.actor_cfg, "temperature", 1.0)
        denom = self.global_denominator(micro_batches, denominator_fn)
        safe = torch.clamp(denom, min=1.0).to(self.mesh.device)
        self._set_mode(True)
        for c in self.model:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        step = partial(
            self._forward_step,
            collect=False,
            temperature=temperature,
            return_entropy=return_entropy,
            loss_fn=loss_fn,
            denominator=safe,
        )
        if self.moe_aux is not None:  # router aux loss scaled per token for this step
            out = self.moe_aux.run(self._run_schedule, micro_batches, step, False, False)
        else:
            out = self._run_schedule(micro_batches, step, forward_only=False, collect=False)
        stats = reduce_stats(out, self.mesh)
        stats["n_tokens"] = float(denom)
        return stats

    def optimizer_step(self, loss: Optional[float] = None) -> dict:
        """Clip, step the optimizer and the LR schedule. Returns grad_norm and lr.

        Never applies a non-finite update: when ``loss`` or any gradient is NaN/inf on any
        trainer rank (a flag all-reduced over the trainer's default process group, so every
        rank decides alike), the optimizer and the LR schedule do not step and the stats say
        ``skipped`` 1 with ``nonfinite_loss`` / ``nonfinite_grad``. fp16 keeps megatron's own
        ``found_inf`` check for the gradients (its loss scaler must see the overflow)."""
        lr = self.current_lr()
        grads = () if self.model_cfg.dtype == "fp16" else model_grads(self.model)
        bad_loss, bad_grad = nonfinite_flags(loss, grads, self.mesh.device)
        if bad_loss or bad_grad:
            return {
                "grad_norm": math.nan,
                "lr": lr,
                "update_successful": 0.0,
                "skipped": 1.0,
                "nonfinite_loss": float(bad_loss),
                "nonfinite_grad": float(bad_grad),
            }
        ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.lr_scheduler.step(increment=1)
            self.step_count += 1
        return {
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": lr,
            "update_successful": float(bool(ok)),
            "skipped": 0.0,
        }

    def train_batch(
        self,
        micro_batches: Sequence[dict],
        loss_fn: LossFn,
        denominator_fn: Optional[Callable] = None,
        *,
        temperature: Optional[float] = None,
        return_entropy: bool = False,
    ) -> dict:
        """One optimizer step on ``micro_batches`` (this DP rank's share of the batch).

        Returns stats: ``loss`` (Σ numerators / global denominator), ``grad_norm`` (before
        clipping), ``lr`` (used by this step), ``n_tokens`` (global denominator), ``skipped``
        (1: a non-finite loss or gradient, no update applied, :meth:`optimizer_step`), plus
        every ``loss_fn`` stat summed over micro-batches and DP ranks."""
        stats = self.forward_backward(
            micro_batches,
            loss_fn,
            denominator_fn,
            temperature=temperature,
            return_entropy=return_entropy,
        )
        stats.update(self.optimizer_step(loss=stats.get("loss")))
        return stats

    def step_lr(self, n: int = 1) -> None:
        """Advance the LR schedule by ``n`` steps without an optimizer step."""
        self.lr_scheduler.step(increment=n)

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    # ------------------------------------------------------------------ checkpoint access
    def sharded_state_dict(self) -> dict:
        """Model sharded state dict (``model`` or ``model0``, ``model1``… with VPP), the
        layout megatron's dist_checkpointing saves and reshards."""
        sd = {}
        for i, c in enumerate(self.model_chunks()):
            key = "model" if len(self.model) == 1 else f"model{i}"
            sd[key] = c.sharded_state_dict()
        return sd

    def model_chunks(self) -> list:
        """The bare ``GPTModel`` chunks (DDP wrappers removed): keys and parameter names are
        the same for actor and reference."""
        return [getattr(c, "module", c) for c in self.model]

    @property
    def checkpoint_keys(self):
        """The model keys a checkpoint of this engine holds: None (all), or with LoRA the
        adapters' (:func:`areal_mega.lora.actor.adapter_keys`)."""
        from areal_mega.lora.actor import adapter_keys

        return adapter_keys if self.lora is not None else None

    def save(self, directory: str, extra: Optional[dict] = None) -> None:
        """Save model, optimizer, LR scheduler and RNG (+ ``extra``) as a checkpoint under
        ``directory`` (``<directory>/iter_<step>``, atomic; see
        :mod:`areal_mega.checkpoint.dist_ckpt`). Collective over all ranks."""
        from areal_mega.checkpoint.dist_ckpt import save_checkpoint

        save_checkpoint(
            directory,
            self.step_count,
            self.model_chunks(),
            self.optimizer,
            self.lr_scheduler,
            extra=extra,
            model_keys=self.checkpoint_keys,
        )

    def load(self, directory: str) -> Optional[dict]:
        """Load the latest checkpoint under ``directory`` (or one ``iter_*`` directory) into
        any TP/PP/EP layout (resharding); returns the saved ``extra``."""
        from areal_mega.checkpoint.dist_ckpt import load_checkpoint

        loaded = load_checkpoint(
            directory,
            self.model_chunks(),
            self.optimizer,
            self.lr_scheduler,
            model_keys=self.checkpoint_keys,
        )
        self.step_count = loaded.iteration
        return loaded.extra
