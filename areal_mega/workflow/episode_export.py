"""From an episode's recorded completions to training samples.

When every call extends the previous one exactly — call k's prompt tokens start with call
k-1's prompt + completion tokens — the episode is ONE sequence: the first prompt, then each
completion (trained: loss_mask 1, its logprobs and per-token versions) and between them the
tokens the next prompt added (tool results, environment, the next user turn: loss_mask 0,
logprob 0, version -1). Otherwise each completion is its own sample, all sharing the
episode's reward, discounted by ``discount ** (K-1-k)`` for completion k of K (the last
completion gets the full reward). Tokens and logprobs are copied from the records, which hold
what the servers generated; nothing is re-tokenised.

A sample whose (last) call had images (a vision-language policy, ``image_url`` parts) carries
them: ``multimodal`` from the sample context's image processor over the record's decoded
images (what ``encode_sample`` gives the same images), and ``meta["image_data"]`` the images
as the call sent them to the servers (what a served teacher scores it with). A chained
episode's last call holds every image of the conversation.
"""

from __future__ import annotations

import numpy as np

from areal_mega.workflow.tokens import TokenSeq


def chains(records: list) -> bool:
    """Whether each record's prompt extends the previous record's prompt + completion."""
    for prev, cur in zip(records, records[1:]):
        head = list(prev.prompt_ids) + list(prev.output_ids)
        if list(cur.prompt_ids[: len(head)]) != head:
            return False
    return True


def plan_samples(records: list, reward: float, discount: float = 1.0) -> list:
    """Pure planning: ``[(TokenSeq, reward, prompt_len, record indices)]`` for ``records``
    (see the module doc). Empty records give no sample."""
    if not records:
        return []
    if chains(records):
        seq = TokenSeq()
        seq.add_context(records[0].prompt_ids)
        for k, rec in enumerate(records):
            if k:
                seq.add_context(rec.prompt_ids[len(seq.input_ids) :])
            seq.add_generated(rec.output_ids, rec.logprobs, rec.versions, rec.routed_experts)
        return [(seq, float(reward), len(records[0].prompt_ids), list(range(len(records))))]
    out, K = [], len(records)
    for k, rec in enumerate(records):
        seq = TokenSeq()
        seq.add_context(rec.prompt_ids)
        seq.add_generated(rec.output_ids, rec.logprobs, rec.versions, rec.routed_experts)
        out.append((seq, float(reward) * discount ** (K - 1 - k), len(rec.prompt_ids), [k]))
    return out


def record_images(ctx, rec) -> tuple:
    """``(multimodal, meta)`` of record ``rec``'s prompt images: the processed images (the
    sample context's ``image_processor``) and ``{"image_data": [...]}`` as sent; ``(None,
    {})`` for a prompt without images."""
    if not rec.images:
        return None, {}
    enc = ctx.image_processor(images=list(rec.images), return_tensors="pt")  # encode_sample's
    mm = {
        "pixel_values": enc["pixel_values"].float().numpy(),
        "image_grid_thw": enc["image_grid_thw"].numpy().astype(np.int32),
    }
    return mm, {"image_data": list(rec.image_data)}


def export_completions(ctx, reward: float, records: list, discount: float = 1.0) -> list:
    """Trajectories of one sample (``ctx``: a
    :class:`~areal_mega.workflow.api.SampleContext`) from its records."""
    plans = plan_samples(records, reward, discount)
    out = []
    for i, (seq, r, plen, idx) in enumerate(plans):
        last = records[idx[-1]]
        mm, image_meta = record_images(ctx, last)
        out.append(
            ctx.trajectory(
                seq,
                r,
                plen,
                last.finish_reason,
                suffix="" if len(plans) == 1 else f"-c{i}",
                server_id=last.server,
                meta={
                    "n_calls": len(idx),
                    "chained": len(plans) == 1 and len(records) > 1,
                    "n_interruptions": sum(records[j].n_interruptions for j in idx),
                    **image_meta,
                },
                multimodal=mm,
            )
        )
    return out
