"""One rank of tests/test_new_families.py's 2-rank checks of a new model family.

    python -m tests.helpers.family_worker <family> <rank> <world> <port> <work_dir>

(``all`` for ``<family>``: every family in turn, or those named in ``$AREAL_TEST_FAMILIES``,
each family's checks under its name, as tests/test_new_families.py runs them.)

``<work_dir>/<family>/hf`` is the tiny HF model and ``<work_dir>/<family>/mcore`` its
checkpoint converted by ``tools/convert_hf_to_mcore.py``. On the DP2 mesh and on each layout of
the family's case (:data:`tests.helpers.new_families.CASES`):

* ``<layout>.hf_logits``: the converted checkpoint loaded into the engine in that layout, its
  logits (unpacked forward, TP-gathered; non-pipelined layouts) minus transformers' logits;
* ``<layout>.export`` / ``.export_missing``: its live weight export (the rollout servers'
  weights) against the HF checkpoint, bit for bit, and the checkpoint's tensors not exported;
* ``<layout>.hf_packed``: its packed per-token logprobs (``forward_logprobs``, several
  sequences in one micro-batch) minus transformers' (each sequence alone);
* ``dp2_<variant>.hf_logits`` / ``.hf_packed``: the same under each of the case's
  ``config_variants`` (config overrides given to both the engine and transformers);
* ``<layout>.{logprobs,grads,loss,n_tokens}``: the layout against the single-rank reference
  with the production PPO loss, exactly as tests/helpers/engine_worker.py checks the dense families.
* ``dp2.distopt_step``: one optimizer step with the distributed optimizer against the same
  step with the regular one (:func:`tests.helpers.engine_worker.distopt_step`).

Rank r writes ``<work_dir>/<family>.<r>.json`` ({check: max abs difference}).
"""

import json
import os
import sys
from pathlib import Path

import torch

from tests.helpers import engine_worker as ew
from tests.helpers import group_batches
from tests.helpers.new_families import CASES

#: layout name -> ParallelDims of the 2-rank mesh; EP2 runs inside DP2 (half the batch each)
#: ``tp2sp``: TP2 with sequence parallelism (megatron requires it for MoE with TP);
#: ``tp2sp_etp1``: the same with the routed experts whole on each rank (expert TP 1, MoE
#: parallel folding: ``megatron:(attn:t2|ffn:t1)``, expert DP 2 over the TP ranks' tokens)
MESHES = {
    "dp2": dict(dp=2),
    "tp2": dict(tp=2),
    "tp2sp": dict(tp=2),
    "tp2sp_etp1": dict(tp=2, etp=1),
    "pp2": dict(pp=2),
    "ep2": dict(dp=2, ep=2),
    "pp2_recompute": dict(pp=2),
    "tp2sp_recompute": dict(tp=2),
    "pp2_vpp2": dict(pp=2),
    "pp2_vpp2_recompute": dict(pp=2),
}
#: layouts with virtual pipeline stages (the interleaved schedule): their VPP size
VPP = {"pp2_vpp2": 2, "pp2_vpp2_recompute": 2}
#: layouts whose actor recomputes every layer's activations in backward (full recompute)
FULL_RECOMPUTE = ("pp2_recompute", "tp2sp_recompute", "pp2_vpp2_recompute")
HALF_BATCH = ("dp2", "ep2")
#: the environment variable naming the families ``all`` runs (tests/test_new_families.py sets
#: it to the families its selected tests check)
FAMILIES_ENV = "AREAL_TEST_FAMILIES"
SEQUENCE_PARALLEL = ("tp2sp", "tp2sp_recompute", "tp2sp_etp1")


def hf_reference(hf_dir, seqs, overrides=None):
    """transformers' logits of the first two (equally long) sequences as one batch, and every
    sequence's next-token logprobs (``overrides``: config fields changed at load); eager
    attention, transformers' reference (its SDPA path drops Gemma 2's attention soft-cap)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="eager", **(overrides or {})
    ).eval()
    with torch.no_grad():
        logits = m(input_ids=torch.stack(seqs[:2])).logits
        lps = []
        for s in seqs:
            lp = torch.log_softmax(m(input_ids=s[None]).logits[0].float(), -1)
            lps.append(lp[:-1].gather(1, s[1:, None])[:, 0])
    return logits, lps


def exported_vs_checkpoint(res, tag, eng, hf_config, hf_dir):
    """The live weight export (what rollout servers receive) of the loaded engine against the
    HF checkpoint it was converted from: ``<tag>.export`` the largest difference of a tensor
    this rank exports (bit-exact: 0), ``<tag>.export_missing`` the checkpoint's tensors no
    rank exported."""
    import torch.distributed as dist

    from areal_mega.checkpoint import hf_mapping as hm
    from areal_mega.checkpoint.export import iter_hf_tensors
    from tests.helpers.convert_worker import load_all

    src = load_all(hf_dir)
    exported = {
        n: t.clone() for n, t in iter_hf_tensors(eng.model_chunks(), hm.read_arch(hf_config))
    }
    res[f"{tag}.export"] = max(
        float("inf") if n not in src or t.shape != src[n].shape else (t - src[n]).abs().max().item()
        for n, t in exported.items()
    )
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, sorted(exported))
    res[f"{tag}.export_missing"] = len(set(src) - {n for ns in names for n in ns})


def converted_vs_hf(res, tag, hf_config, mcore_dir, hf_seqs, want_logits, want_lps):
    """The converted checkpoint in the current layout (an engine built from ``hf_config``)
    against transformers."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from areal_mega.checkpoint.dist_ckpt import load_checkpoint
    from areal_mega.config import ModelConfig
    from areal_mega.engine import MegatronEngine
    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.batches import next_token_layout

    eng = MegatronEngine(
        ModelConfig(dtype="fp32"), hf_config=hf_config, role="ref", mesh=ew.MESH[0], seed=5
    )
    load_checkpoint(mcore_dir, eng.model_chunks(), load_optimizer=False, load_rng=False)
    exported_vs_checkpoint(res, tag, eng, hf_config, Path(mcore_dir).parent / "hf")
    mb = pack_sequences([next_token_layout(s) for s in hf_seqs], pad_to_multiple=2)
    got = eng.forward_logprobs([mb, mb])[0]  # PP needs a micro-batch per stage in flight
    res[f"{tag}.hf_packed"] = max(
        (got[int(mb["cu_seqlens"][b]) : int(mb["cu_seqlens"][b]) + len(w)] - w).abs().max().item()
        for b, w in enumerate(want_lps)
    )
    if eng.mesh.dims.pp == 1:
        chunk = eng.model_chunks()[0]
        ids = torch.stack(hf_seqs[:2])
        if eng.config.sequence_parallel:  # the sequence splits over TP: a multiple of it (causal,
            # so a prefix's logits are the full run's first rows)
            ids = ids[:, : ids.shape[1] - ids.shape[1] % eng.config.tensor_model_parallel_size]
            want_logits = want_logits[:, : ids.shape[1]]
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        with torch.no_grad():
            out = chunk(input_ids=ids, position_ids=pos, attention_mask=None)
        g = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(g))]
        dist.all_gather(parts, out.contiguous(), group=g)
        got_logits = torch.cat(parts, dim=-1)[..., : want_logits.shape[-1]]
        res[f"{tag}.hf_logits"] = (got_logits - want_logits).abs().max().item()


def run_family(name):
    """The scenario of family ``name`` (see the module docstring)."""
    case = CASES[name]

    def scenario(res, out_dir):
        rank = int(os.environ["RANK"])
        work = Path(out_dir) / name
        hf_dir, mcore_dir = work / "hf", work / "mcore"
        cfg = json.loads((hf_dir / "config.json").read_text())
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(3, cfg["vocab_size"], (n,), generator=g) for n in (21, 21, 5, 13)]
        want_logits, want_lps = hf_reference(hf_dir, seqs)
        # the layouts' reference: this family's config with the shared test vocabulary (both
        # spellings of MoE keys filled in: tests/helpers/engine_worker.py reads ``num_experts``) and
        # no MoE aux loss (the reference is the plain autograd of the policy loss; the aux
        # loss's per-step scaling is checked by tests/test_moe_aux.py)
        from areal_mega.models.builder import normalize_hf_config

        hf = normalize_hf_config(dict(cfg, vocab_size=ew.VOCAB, router_aux_loss_coef=0.0))
        if hf.get("vocab_size_per_layer_input"):  # Gemma 4's per-layer inputs: same vocabulary
            hf["vocab_size_per_layer_input"] = ew.VOCAB
        for key in ("n_routed_experts", "moe_num_experts"):  # DeepSeek's, Ernie's spellings
            if hf.get(key) and not hf.get("num_experts"):
                hf["num_experts"] = hf[key]
        mbs = ew.make_mbs(1, [[9, 14, 5], [20, 3], [6, 6, 6, 4], [17]])
        ew.set_mesh(MESHES["dp2"])
        converted_vs_hf(res, "dp2", cfg, mcore_dir, seqs, want_logits, want_lps)
        for variant, overrides in case.config_variants.items():
            converted_vs_hf(
                res,
                f"dp2_{variant}",
                dict(cfg, **overrides),
                mcore_dir,
                seqs,
                *hf_reference(hf_dir, seqs, overrides),
            )
        ref = ew.reference(hf, mbs, seed=11, loss=ew.POLICY)
        ew.check_layout(
            res, "dp2", hf, ref, mbs, my_mbs=mbs[rank::2], my_ref_lps=ref["lps"][rank::2]
        )
        ew.distopt_step(res, "dp2", hf, ref, mbs[rank::2])
        for layout in case.layouts:
            ew.set_mesh(MESHES[layout], sp=layout in SEQUENCE_PARALLEL, vpp=VPP.get(layout))
            converted_vs_hf(res, layout, cfg, mcore_dir, seqs, want_logits, want_lps)
            half = layout in HALF_BATCH
            ew.check_layout(
                res,
                layout,
                hf,
                ref,
                mbs,
                my_mbs=mbs[rank::2] if half else None,
                my_ref_lps=ref["lps"][rank::2] if half else None,
                recompute="full" if layout in FULL_RECOMPUTE else None,
            )
        if case.shared_prompts:
            group_batches.shared_prompt_layouts(res, 2, ew, hf=hf)

    return scenario


def run_all(res, out_dir):
    """Every family's scenario one after the other (one pair of processes; only those named in
    ``$AREAL_TEST_FAMILIES``, comma-separated, when set): ``res[family]`` holds each family's
    checks."""
    names = os.environ.get(FAMILIES_ENV)
    for name in names.split(",") if names else CASES:
        res[name] = {}
        run_family(name)(res[name], out_dir)


if __name__ == "__main__":
    sys.exit(ew.run_scenario({**{n: run_family(n) for n in CASES}, "all": run_all}))
