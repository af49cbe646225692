"""Context-parallel loss equality, run by tests/test_engine_cp_loss.py in 2 gloo processes.

    python -m tests.helpers.cp_loss_worker <rank> <world> <port> <out_dir>

The mesh is a real CP=2 ``ParallelMesh`` (megatron's parallel state over gloo; no model: the
model side of CP needs TransformerEngine). Every rank holds the same packed micro-batches
(packed for CP=2) and the same per-token logprobs / entropies, standing in for one CP=1 model
run. For each loss configuration:

* CP=1: :func:`areal_mega.engine.loss_context.compute_loss` (what the engine's ``_on_output``
  calls) on the whole micro-batches; backward of ``numerator / D``;
* CP=2: the same call on this rank's share (the engine's own split,
  :func:`areal_mega.engine.packed.cp_token_index`) with the CP group's ``CPShard``; stats reduced
  with :func:`areal_mega.engine.loss_context.reduce_stats` (the engine's), gradients w.r.t. the
  shard's logprobs / entropies gathered over CP and merged back (as ``forward_logprobs`` does).

Rank r writes ``<out_dir>/cp_loss.<r>.json``: {config: {check: max_abs_diff or value}}.
"""

import dataclasses
import json
import os
import sys
import traceback

import torch

LENS = [[9, 14, 5], [20, 3], [6, 6, 6, 4], [1, 17, 2]]
POLICY_VERSION = 3


def configs():
    """(name, cfg) of every aggregation mode and sequence-level option; cfg None = SFT."""
    from areal_mega.config import AlgorithmConfig

    base = AlgorithmConfig(kl_coef=0.05, entropy_coef=0.01)
    rep = dataclasses.replace
    return [
        ("token_mean", base),
        ("seq_mean", rep(base, loss_agg="seq_mean")),
        ("seq_sum_norm", rep(base, loss_agg="seq_sum_norm", loss_norm_len=16)),
        ("gspo_seq_mean", rep(base, ratio_level="sequence", loss_agg="seq_mean")),
        (
            "gspo_token_mean_geometric",
            rep(
                base, ratio_level="sequence", imp_weight_level="geometric", behav_imp_weight_cap=1.1
            ),
        ),
        (
            "seq_weight_mask",
            rep(base, imp_weight_level="sequence", behav_imp_weight_cap=1.5, loss_agg="seq_mean"),
        ),
        (
            "seq_weight_clamp",
            rep(
                base,
                imp_weight_level="sequence",
                behav_imp_weight_cap=1.5,
                imp_weight_mode="clamp",
                loss_agg="seq_sum_norm",
                loss_norm_len=16,
            ),
        ),
        ("ppo_dual_clip", rep(base, decoupled=False, dual_clip_c=3.0)),
        ("sft", None),
    ]


def make_batches(cp):
    """Micro-batches packed for ``cp`` plus full-length logprobs / entropies per micro-batch."""
    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.batches import next_token_layout

    g = torch.Generator().manual_seed(5)
    mbs, lps, ents = [], [], []
    for lens in LENS:
        seqs = []
        for n in lens:
            prox = -torch.rand(n, generator=g) * 3
            seqs.append(
                {
                    "input_ids": torch.randint(0, 100, (n,), generator=g),
                    "prompt_len": max(1, n // 3),
                    "advantages": torch.randn(1, generator=g).expand(n).clone(),
                    "prox_logprobs": prox,
                    "logprobs": prox + (torch.rand(n, generator=g) - 0.5) * 0.4,
                    "ref_logprobs": prox + (torch.rand(n, generator=g) - 0.5) * 0.4,
                    "versions": torch.randint(
                        POLICY_VERSION - 1, POLICY_VERSION + 1, (n,), generator=g
                    ).int(),
                    "lp": prox + (torch.rand(n, generator=g) - 0.5) * 0.6,
                    "ent": torch.rand(n, generator=g) * 2,
                }
            )
        seqs = [{**s, **next_token_layout(s["input_ids"])} for s in seqs]  # + labels
        mb = pack_sequences(seqs, pad_to_multiple=2 * cp, cp_size=cp)
        mb["policy_version"] = POLICY_VERSION
        mb["token_keys"] = [k for k in mb["token_keys"] if k not in ("lp", "ent")]
        lps.append(mb.pop("lp").float())
        ents.append(mb.pop("ent").float())
        mbs.append(mb)
    return mbs, lps, ents


def run_config(cfg, mesh, mbs, lps, ents):
    import torch.distributed as dist

    from areal_mega.algo import make_policy_loss
    from areal_mega.engine.loss_context import (
        CPShard,
        compute_loss,
        global_denominator,
        reduce_stats,
    )
    from areal_mega.engine.megatron_engine import default_denominator
    from areal_mega.engine.packed import cp_token_index, micro_batch_labels, zigzag_merge
    from areal_mega.train.sft import sft_loss

    if cfg is None:
        loss_fn, den_fn = sft_loss, default_denominator
    else:
        loss_fn, den_fn = make_policy_loss(cfg)
    denom = torch.clamp(global_denominator(mbs, den_fn, mesh), min=1.0)
    cp, rank = mesh.dims.cp, mesh.cp_rank
    shard = CPShard(mesh.cp_group, cp, rank)
    stats1, recs2 = {}, []
    res = {"grad_lp": 0.0, "grad_ent": 0.0, "grad_lp_max": 0.0}
    for mb, lp_full, ent_full in zip(mbs, lps, ents):
        valid = micro_batch_labels(mb, lp_full.numel()) >= 0  # as the engine's _prepare
        # ---- CP=1: the whole micro-batch
        lp1 = lp_full.clone().requires_grad_()
        ent1 = ent_full.clone().requires_grad_()
        loss1, _, rec1 = compute_loss(loss_fn, lp1, ent1, mb, denominator=denom, valid=valid)
        loss1.backward()
        for k, v in rec1.items():
            stats1[k] = stats1.get(k, 0.0) + float(v)
        # ---- CP=2: this rank's share, the engine's split and shard
        idx = cp_token_index(mb, cp, rank)
        lp2 = lp_full[idx].clone().requires_grad_()
        ent2 = ent_full[idx].clone().requires_grad_()
        loss2, _, rec2 = compute_loss(
            loss_fn, lp2, ent2, mb, denominator=denom, valid=valid[idx], index=idx, shard=shard
        )
        loss2.backward()
        recs2.append(rec2)
        bounds = mb["cu_seqlens_padded"].tolist()
        total = lp_full.numel()
        for key, mine, ref in (("grad_lp", lp2.grad, lp1.grad), ("grad_ent", ent2.grad, ent1.grad)):
            if mine is None or ref is None:  # a loss without an entropy term
                res[key] = max(res[key], float((mine is None) != (ref is None)))
                continue
            parts = [torch.empty_like(mine) for _ in range(cp)]
            dist.all_gather(parts, mine.contiguous(), group=mesh.cp_group)
            merged = zigzag_merge(parts, bounds, total)
            res[key] = max(res[key], (merged - ref).abs().max().item())
        res["grad_lp_max"] = max(res["grad_lp_max"], lp1.grad.abs().max().item())
    stats2 = reduce_stats(recs2, mesh)
    res["stat_keys_equal"] = float(sorted(stats1) == sorted(stats2))
    for k, v in stats1.items():
        res[f"stat.{k}"] = abs(stats2.get(k, float("nan")) - v) / max(1.0, abs(v))
    res["loss_value"] = stats1["loss"]
    res["values"] = stats1
    return res


def main():
    rank, world, port, out_dir = sys.argv[1:5]
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    res, mesh = {}, None
    try:
        from areal_mega.parallel.allocation import ParallelDims
        from areal_mega.parallel.mesh import ParallelMesh

        mesh = ParallelMesh.create(ParallelDims(cp=int(world)), timeout_s=90)
        mbs, lps, ents = make_batches(mesh.dims.cp)
        for name, cfg in configs():
            res[name] = run_config(cfg, mesh, mbs, lps, ents)
    except Exception:
        res["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"cp_loss.{rank}.json"), "w") as f:
        json.dump(res, f, indent=1)
    if mesh is not None:
        try:
            mesh.destroy(process_group=True)
        except Exception:
            pass
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
