"""Supervised fine-tuning on the same engine: prompt -> answer + EOS, loss on the answer.

Used to warm-start the CPU demo before RL, and by users (``mode=sft``). Each step takes
``data.sft_batch_size`` examples (shuffled per epoch, resumable), packs them into token-budget
micro-batches over the DP ranks, and minimises the mean negative log-likelihood of the answer
tokens. At the end the weights are exported as an HF directory ``<run_dir>/hf_model`` (with
``lora.enabled``: the adapters merged in, and the adapter alone in ``<run_dir>/adapter``).

A vision-language model (Qwen2.5-VL) trains on records with images (the formats of
:mod:`areal_mega.data.images`, ``data.images.*``) read as the RL workflow reads them
(:class:`~areal_mega.data.dataset.PromptDataset`): at start each record's images are checked
and its prompt expanded (one ``<|image_pad|>`` per merged patch; ``data.max_prompt_len`` counts
the expanded prompt); the pixels are decoded again when a step draws the record, and each
packed micro-batch carries the ``pixel_values`` / ``image_grid_thw`` of its samples in packed
order, as the engine reads them. Against ``scheduler.max_tokens_per_mb`` a sample with images
costs its tokens plus one per merged patch (the vision tower's work), as in the RL step.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from areal_mega.algo.policy_loss import check_devices, reads_loss_mask_only
from areal_mega.data.dataset import PromptDataset, PromptSampler, load_tokenizer
from areal_mega.data.vision_prompts import IMAGE_PAD
from areal_mega.scheduler import plan_micro_batches
from areal_mega.train import batches
from areal_mega.train.weights import export_hf_dir


@reads_loss_mask_only
def sft_loss(logprobs: torch.Tensor, entropy, mb: dict):
    """Engine loss contract: numerator = Σ NLL over loss tokens (denominator: their count).

    Per-token sums only, so a context-parallel rank's share needs no cross-rank term; its
    inputs must be on the device of ``logprobs`` (a ValueError names the field otherwise)."""
    check_devices(logprobs, mb, ("loss_mask",), entropy)
    mask = mb["loss_mask"].to(logprobs.dtype)
    nll = -(logprobs * mask).sum()
    return nll, {
        "nll_sum": nll.detach(),
        "token_count": mask.sum(),
        "correct_sum": ((logprobs.detach() > -0.6931).float() * mask).sum(),
    }


def sft_sample(prompt_ids: list, answer_ids: list, eos_id: int) -> dict:
    """A packable dict in next-token layout: position t predicts token t+1."""
    ids = np.asarray(list(prompt_ids) + list(answer_ids) + [eos_id], dtype=np.int32)
    mask = np.zeros(len(ids), dtype=np.uint8)
    mask[len(prompt_ids) :] = 1
    return {**batches.next_token_layout(ids, loss_mask=mask), "prompt_len": len(prompt_ids)}


class DatasetImages:
    """Each SFT sample's images (``images[i]`` -> ``(pixel_values, image_grid_thw)``,
    ``(None, None)`` for a text prompt), decoded and encoded when a step draws the record
    (:meth:`~areal_mega.data.vision_prompts.VisionPrompts.inputs`, as the RL workflow does:
    the same ``data.images.*`` resize), so a dataset's pixels are never all in memory."""

    def __init__(self, data: PromptDataset, tokenizer):
        self.data, self.tokenizer = data, tokenizer
        pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        #: each sample's image tokens (one per merged patch), without decoding an image
        self.image_tokens = [
            it.input_ids.count(pad) if it.vision is not None else 0 for it in data.items
        ]

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __getitem__(self, i: int) -> tuple:
        source = self.data.items[i].vision
        if source is None:
            return None, None
        mm = self.data.vision.inputs(source, self.tokenizer)["multimodal"]
        return torch.from_numpy(mm["pixel_values"]), torch.from_numpy(mm["image_grid_thw"])


def sft_samples(data_cfg, tokenizer, model_dir: str) -> tuple:
    """The SFT samples of ``data_cfg.train_path``: ``(samples, images)``, ``samples[i]`` the
    :func:`sft_sample` of record i's prompt (a prompt with images: expanded, one
    ``<|image_pad|>`` per merged patch, :class:`~areal_mega.data.dataset.PromptDataset`) and
    answer; ``images`` a :class:`DatasetImages`, or None when no prompt has images.
    ``model_dir``: the model whose image processor encodes the images."""
    data = PromptDataset.from_config(data_cfg, tokenizer, model_dir=model_dir)
    answers = tokenizer([str(it.answer) for it in data.items], add_special_tokens=False)
    samples = [
        sft_sample(it.input_ids, a, tokenizer.eos_token_id)
        for it, a in zip(data.items, answers["input_ids"])
    ]
    with_vision = any(it.vision is not None for it in data.items)
    return samples, DatasetImages(data, tokenizer) if with_vision else None


def with_images(packed: dict, images: list) -> dict:
    """A packed micro-batch with the ``pixel_values`` / ``image_grid_thw`` of its samples
    (``images``: each sample's pair, in packed order; None when no sample has an image)."""
    pv = [p for p, _ in images if p is not None]
    grid = [g for p, g in images if p is not None]
    return dict(
        packed,
        pixel_values=torch.cat(pv) if pv else None,
        image_grid_thw=torch.cat(grid) if grid else None,
    )


def run_sft(s) -> None:
    """Train ``cfg.total_steps`` SFT steps on ``data.train_path``; export the HF model."""
    from areal_mega.lora.actor import merged_deltas, publish_adapter
    from areal_mega.scheduler.packing import pack_sequences

    cfg = s.cfg
    tok = load_tokenizer(cfg.model.path)
    samples, images = sft_samples(cfg.data, tok, cfg.model.path)
    sampler = PromptSampler(
        len(samples),
        cfg.data.sft_batch_size,
        seed=cfg.seed,
        shuffle=cfg.data.shuffle,
        drop_last=cfg.data.drop_last,
    )
    for _ in range(s.start_step):  # resume: replay the sampler to the same position
        sampler.next_indices()
    pad_to = s.layout["tp_size"] * (2 * s.layout["cp_size"] if s.layout["cp_size"] > 1 else 1)
    for step in range(s.start_step + 1, cfg.total_steps + 1):
        t0 = time.time()
        plan = None
        if s.is_rank0:
            idx = sampler.next_indices()
            chosen = [samples[i] for i in idx]
            # a sample with images also costs its vision tower's work, one token per merged
            # patch (as the RL step counts it: train/batches.py budget_lengths)
            mb_plan = plan_micro_batches(
                [
                    len(x["input_ids"]) + (0 if images is None else images.image_tokens[i])
                    for x, i in zip(chosen, idx)
                ],
                dp_size=s.layout["dp_size"],
                max_tokens_per_mb=cfg.scheduler.max_tokens_per_mb,
                pp_size=s.layout["pp_size"],
            )
            per_rank = [
                [
                    pack_sequences(
                        [chosen[i] for i in mb], pad_to_multiple=pad_to, cp_size=s.layout["cp_size"]
                    )
                    if images is None
                    else with_images(
                        pack_sequences(
                            [chosen[i] for i in mb],
                            pad_to_multiple=pad_to,
                            cp_size=s.layout["cp_size"],
                        ),
                        [images[idx[i]] for i in mb],
                    )
                    for mb in rank
                ]
                for rank in mb_plan
            ]
            plan = batches.StepPlan(
                micro_batches=per_rank,
                sample_ids=[],
                stats={"n_tokens_total": float(sum(len(x["input_ids"]) for x in chosen))},
            )
        else:
            sampler.next_indices()
        batch = batches.distribute(plan, s.mesh)
        st = s.actor.train_batch(batch.micro_batches, sft_loss)
        n_tok = max(st.get("token_count", 1.0), 1.0)
        dt = time.time() - t0
        skip = s.skips.record(
            step, {**st, "skipped_minibatches": st.get("skipped", 0.0)}, batch.micro_batches
        )  # a non-finite step: no update applied
        s.log(
            step,
            {
                "loss": st["loss"],
                "nll": st["nll_sum"] / n_tok,
                "token_acc": st["correct_sum"] / n_tok,
                "grad_norm": st["grad_norm"],
                "lr": st["lr"],
                "time/step": dt,
                "tokens/s": batch.stats["n_tokens_total"] / max(dt, 1e-9),
                **skip,
            },
        )
        s.skips.check()
        s.maybe_checkpoint(step)
    lora = s.actor.lora  # LoRA SFT: the adapters merged in (and, apart, as PEFT)
    export_hf_dir(
        s.actor,
        cfg.model.path,
        s.run_dir / "hf_model",
        is_writer=s.is_rank0,
        deltas=merged_deltas(s.actor) if lora is not None else None,
    )
    if lora is not None:
        publish_adapter(
            s.actor, s.run_dir / "adapter", base_model=cfg.model.path, is_writer=s.is_rank0
        )
    if s.is_rank0:
        print(
            f"[areal-mega] SFT model (HF format): {s.run_dir / 'hf_model'}"
            + (f"; its LoRA adapter (PEFT): {s.run_dir / 'adapter'}" if lora else "")
        )
    s.finish()
