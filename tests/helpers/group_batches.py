"""Micro-batches of GRPO-like prompt groups for the engine tests (the engine computes each
shared prompt once, areal_mega/scheduler/shared_prefix.py), and the multirank check of that
path (run by tests/helpers/engine_worker.py's dense scenario)."""

import torch


def make_group_mbs(seed, groups_per_mb, pad=8, vocab=200):
    """Micro-batches of GRPO-like groups, ``(prompt length, [completion lengths])`` each: the
    samples of a group share their prompt (the engine computes it once), the loss mask is in
    the production next-token layout."""
    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.batches import next_token_layout

    g = torch.Generator().manual_seed(seed)
    mbs = []
    for groups in groups_per_mb:
        seqs = []
        for p, comps in groups:
            prompt = torch.randint(0, vocab, (p,), generator=g)
            for n in comps:
                ids = torch.cat([prompt, torch.randint(0, vocab, (n,), generator=g)])
                mask = (torch.arange(p + n) >= p).to(torch.uint8)
                seqs.append(
                    {
                        "prompt_len": p,
                        "advantages": torch.randn(1, generator=g).expand(p + n).clone(),
                        **next_token_layout(ids, loss_mask=mask),
                    }
                )
        mbs.append(pack_sequences(seqs, pad_to_multiple=pad))
    return mbs


def shared_prompt_layouts(res, world, ew, hf=None):
    """Shared prompts under PP2 and TP2 against the single-rank reference, with ``ew`` the
    running engine worker module (its mesh, reference and layout check) and ``hf`` the model's
    config (default: ``ew.TIED``); records the rows the pipeline ran per micro-batch."""
    hf = ew.TIED if hf is None else hf
    mbs = make_group_mbs(
        4,
        [[(11, [3, 7, 1]), (5, [4])], [(17, [9, 2, 6, 4])], [(8, [2, 2])], [(3, [6, 1, 5])]],
        vocab=ew.VOCAB,
    )
    ew.set_mesh(dict(dp=world))
    ref = ew.reference(hf, mbs, seed=8, loss=ew.POLICY)
    ew.set_mesh(dict(pp=world))
    eng = ew.check_layout(res, "pp2_shared_prompts", hf, ref, mbs)
    res["pp2_shared_prompts.model_rows"] = [
        int(eng._prepare(mb)["input_ids"].numel()) for mb in mbs
    ]
    del eng
    ew.set_mesh(dict(tp=world))
    ew.check_layout(res, "tp2_shared_prompts", hf, ref, mbs)
