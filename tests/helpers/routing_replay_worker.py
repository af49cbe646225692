"""Routing replay (R3) on a tiny Qwen3-MoE, run by tests/test_routing_replay.py:

    python -m tests.helpers.routing_replay_worker single 0 1 <port> <work>
    python -m tests.helpers.routing_replay_worker layouts <rank> 2 <port> <work>

``single`` (one gloo process): a tiny HF Qwen3-MoE plays the inference server — its own router
(softmax over the gate logits, top-k, in transformers) gives the routes of every token of a few
sequences, captured with forward hooks, and its logprobs are the behaviour logprobs; the last
token of each sequence gets the -1 row the server leaves there. Trajectories carrying
``token_extras["routed_experts"]`` go through the production packing (``next_token_sample``,
``pack_sequences``, ``PackedBatch``) into micro-batches with trailing padding; the HF weights
reach the actor through the production converter. Then: replayed vs free logprobs (identical
weights), a version gap (noise on every router weight) with the production ``routing_metrics``,
router gradients under replay, replay with full activation recompute, the -1 rows, and a
reference model built beside the replaying actor. It saves the perturbed weights, the
micro-batches and the replayed single-rank logprobs / gradients for ``layouts``.

``layouts`` (2 gloo processes): EP2 (inside DP2, each rank half of the micro-batches), TP2 with
sequence parallelism, PP2 and PP2 x VPP2 with full recompute (1F1B: a micro-batch's forward
runs before an earlier one's backward, so the recompute must pop its own targets) replay the
same routes; logprobs and gradients are compared with the single rank's, and the free-routing
agreement counts (each rank counts its own tokens and layers) with the single rank's. Rank r writes
``<work>/<scenario>.<r>.json``.
"""

import os
import sys

import numpy as np
import torch

from tests.helpers import engine_worker as ew  # (shard mapping and gradient comparison)

LENS_PER_MB = [[9, 14, 5], [20, 3], [6, 6, 6, 4], [17, 8]]
NOISE = 0.2  # router-weight noise relative to the router weights' std (version gap)
HF = [None]  # the HF config dict of the tiny model (for the shard mapping)


def hf_rollout(hf_dir, lens, seed=3):
    """The 'server': HF Qwen3-MoE logprobs and routes of random sequences. Returns
    trajectories (prompt third, completion rest, version 0) and the full per-position HF
    logprobs of each sequence (position t: logprob of token t+1)."""
    from transformers import AutoModelForCausalLM

    from areal_mega.dataplane.trajectory import Trajectory

    m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    captured = []
    gates = [layer.mlp.gate for layer in m.model.layers]
    hooks = [
        g.register_forward_hook(lambda mod, inp, out: captured.append(out[2].clone()))
        for g in gates
    ]
    g = torch.Generator().manual_seed(seed)
    vocab = m.config.vocab_size
    trajs, full_lps = [], []
    for i, n in enumerate(lens):
        ids = torch.randint(1, vocab, (n,), generator=g)
        captured.clear()
        with torch.no_grad():
            logits = m(ids[None]).logits[0].float()
        lp = torch.log_softmax(logits, -1)[:-1].gather(1, ids[1:, None])[:, 0]
        routes = torch.stack(captured, dim=1).to(torch.int16)  # [n, layers, topk]
        routes[-1] = -1  # the server never forwards a sequence's last token
        p = max(1, n // 3)
        trajs.append(
            Trajectory.from_tokens(
                ids[:p].numpy(),
                ids[p:].numpy(),
                lp[p - 1 :].numpy(),
                np.zeros(n - p, np.int32),
                reward=float(i % 2),
                sample_id=f"s{i}",
                group_id=f"g{i // 2}",
                token_extras={"routed_experts": routes.numpy()},
            )
        )
        full_lps.append(torch.cat([lp, torch.zeros(1)]))
    for h in hooks:
        h.remove()
    return trajs, full_lps


def packed_micro_batches(trajs, pad=2):
    """The production path from trajectories to micro-batches (advantages: a fixed pattern)."""
    from areal_mega.algo.batch import PackedBatch
    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.batches import next_token_sample

    samples = [next_token_sample(t, np.linspace(-1, 1, t.length).astype(np.float32)) for t in trajs]
    mbs, k = [], 0
    for lens in LENS_PER_MB:
        mbs.append(
            PackedBatch.from_packed(pack_sequences(samples[k : k + len(lens)], pad_to_multiple=pad))
        )
        k += len(lens)
    return [mb.with_fields(policy_version=0) for mb in mbs]


def packed_reference(mbs, full_lps):
    """HF per-position logprobs laid out like each micro-batch, and the valid-label mask."""
    out, k = [], 0
    for mb in mbs:
        lp = torch.zeros(mb.n_tokens)
        starts = mb.cu_seqlens_padded[:-1].tolist()
        for s, n in zip(starts, mb.seqlens.tolist()):
            lp[s : s + n] = full_lps[k]
            k += 1
        out.append((lp, mb.labels >= 0))
    return out


def max_diff(a_list, b_list, masks):
    return max(float((a - b)[m].abs().max()) for a, b, m in zip(a_list, b_list, masks))


def mean_abs_diff(a_list, b_list, masks):
    """Mean |a - b| over every masked position (every position with a label)."""
    total = sum(float((a - b)[m].abs().sum()) for a, b, m in zip(a_list, b_list, masks))
    return total / sum(int(m.sum()) for m in masks)


def actor(hf_dir, *, replay=True, recompute=None, state=None, mcore=None):
    from areal_mega.checkpoint.dist_ckpt import load_checkpoint
    from areal_mega.config import ModelConfig, OptimizerConfig
    from areal_mega.engine import MegatronEngine

    eng = MegatronEngine(
        ModelConfig(dtype="fp32", recompute_granularity=recompute),
        hf_config=str(hf_dir),
        role="actor",
        mesh=ew.MESH[0],
        optimizer_cfg=OptimizerConfig(lr=1e-3, clip_grad=0.0),
        use_distributed_optimizer=False,
        routing_replay=replay,
    )
    if mcore is not None:
        load_checkpoint(mcore, eng.model_chunks(), load_optimizer=False, load_rng=False)
    if state is not None:
        ew.load_reference(eng, {"state": state}, HF[0])
    return eng


def perturb_routers(eng, seed=5):
    g = torch.Generator().manual_seed(seed)
    for n, p in eng.model_chunks()[0].named_parameters():
        if n.endswith("router.weight"):
            p.data += NOISE * p.data.std() * torch.randn(p.shape, generator=g)


def grads_by_name(eng):
    return {n: p.main_grad.detach().clone() for n, p in eng.model_chunks()[0].named_parameters()}


def policy_loss():
    from areal_mega.algo import make_policy_loss
    from areal_mega.config import AlgorithmConfig

    return make_policy_loss(AlgorithmConfig())


def scenario_single(res, work):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from areal_mega.checkpoint.convert import convert_hf_to_mcore
    from areal_mega.config import AlgorithmConfig
    from areal_mega.models.builder import load_hf_config, normalize_hf_config
    from areal_mega.models.tiny import make_tiny_model
    from areal_mega.train import batches
    from areal_mega.train.routing import routing_metrics

    hf_dir = make_tiny_model(
        work / "hf",
        arch="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        num_layers=4,
        tie_word_embeddings=False,
        seed=1,
    )
    HF[0] = normalize_hf_config(load_hf_config(hf_dir))
    lens = [n for mb in LENS_PER_MB for n in mb]
    trajs, full_lps = hf_rollout(hf_dir, lens)
    mbs = packed_micro_batches(trajs)
    ref_layout = packed_reference(mbs, full_lps)
    hf_lps, valid = [r[0] for r in ref_layout], [r[1] for r in ref_layout]
    res["routes_shape"] = list(mbs[0].routed_experts.shape)
    res["routes_dtype"] = str(mbs[0].routed_experts.dtype)
    res["minus_one_rows"] = int(sum(int((mb.routed_experts[:, 0, 0] < 0).sum()) for mb in mbs))
    res["n_seqs"] = len(lens)
    res["n_pad_tokens"] = int(sum(mb.n_tokens - int(mb.cu_seqlens[-1]) for mb in mbs))
    convert_hf_to_mcore(hf_dir, work / "mcore", progress=False)
    ew.set_mesh(dict(dp=1))
    n_before = len(RouterReplay.global_router_replay_instances)
    eng = actor(hf_dir, mcore=work / "mcore")
    res["actor_instances"] = len(eng.replay.instances)
    res["global_instances_added_by_actor"] = (
        len(RouterReplay.global_router_replay_instances) - n_before
    )

    # (a) identical weights: replay == free == HF
    replayed = eng.forward_logprobs(mbs)
    eng.replay.reset_agreement()
    free = eng.forward_logprobs(mbs, free_routing=True)
    res["same.replay_vs_free"] = max_diff(replayed, free, valid)
    res["same.replay_vs_hf"] = max_diff(replayed, hf_lps, valid)
    res["same.agreement"] = list(eng.replay.agreement())
    res["targets_cleared"] = all(
        rr.target_topk_idx is None
        and not rr.replay_backward_list
        and rr.router_replay_action is None
        for rr in eng.replay.instances
    )

    # (d) the -1 rows' stand-in experts never reach a real output
    other = []
    for mb in mbs:
        r = mb.routed_experts.clone()
        r[r[:, 0, 0] < 0] = torch.tensor([7, 5], dtype=r.dtype)
        other.append(dataclass_replace(mb, routed_experts=r))
    res["minus_one.filler_effect"] = max_diff(eng.forward_logprobs(other), replayed, valid)

    # (e) a reference model built beside the replaying actor registers no RouterReplay and
    # routes freely (same HF weights: the HF logprobs), whatever the actor was armed with
    from areal_mega.config import ModelConfig
    from areal_mega.engine import MegatronEngine

    n_actor = len(RouterReplay.global_router_replay_instances)
    ref = MegatronEngine(
        ModelConfig(dtype="fp32"), hf_config=str(hf_dir), role="ref", mesh=ew.MESH[0]
    )
    from areal_mega.checkpoint.dist_ckpt import load_checkpoint

    load_checkpoint(work / "mcore", ref.model_chunks(), load_optimizer=False, load_rng=False)
    res["ref.instances_added"] = len(RouterReplay.global_router_replay_instances) - n_actor
    res["ref.replay"] = ref.replay is not None
    from megatron.core.transformer.moe.router import TopKRouter

    res["ref.routers_without_replay"] = all(
        m.router_replay is None for m in ref.model[0].modules() if isinstance(m, TopKRouter)
    )
    try:
        MegatronEngine(
            ModelConfig(dtype="fp32"),
            hf_config=str(hf_dir),
            role="ref",
            mesh=ew.MESH[0],
            routing_replay=True,
        )
        res["ref.replay_refused"] = ""
    except ValueError as e:
        res["ref.replay_refused"] = str(e)

    # (b) version gap: noise on every router weight of the trainer
    perturb_routers(eng)
    pert_replay = eng.forward_logprobs(mbs)
    mbs_p = batches.attach(mbs, prox_logprobs=pert_replay)
    algo = AlgorithmConfig(routing_replay="r3", routing_replay_free_every=1)
    res["gap.metrics"] = routing_metrics(eng, mbs_p, step=1, algo_cfg=algo, temperature=1.0)
    res["gap.agreement"] = list(eng.replay.agreement())
    pert_free = eng.forward_logprobs(mbs, free_routing=True)
    res["gap.replay_vs_hf_all"] = mean_abs_diff(pert_replay, hf_lps, valid)
    res["gap.free_vs_hf_all"] = mean_abs_diff(pert_free, hf_lps, valid)
    res["ref.after_actor_vs_hf"] = max_diff(ref.forward_logprobs(mbs), hf_lps, valid)

    # single-rank replayed reference for the layouts, and router gradients under replay
    loss_fn, den_fn = policy_loss()
    stats = eng.forward_backward(mbs_p, loss_fn, den_fn)
    grads = grads_by_name(eng)
    res["grad.router_norms"] = [
        float(v.norm()) for n, v in grads.items() if n.endswith("router.weight")
    ]
    res["loss"] = stats["loss"]
    state = {
        k: v.detach().clone()
        for k, v in eng.model_chunks()[0].state_dict().items()
        if not k.endswith("_extra_state")
    }
    torch.save(
        {
            "state": state,
            "mbs": mbs_p,
            "lps": pert_replay,
            "grads": grads,
            "loss": stats["loss"],
            "hf": HF[0],
            "hf_dir": str(hf_dir),
        },
        work / "reference.pt",
    )

    # replay under full activation recompute: the recomputed forward replays the same routes
    rec = actor(hf_dir, recompute="full", state=state)
    rec.forward_backward(mbs_p, loss_fn, den_fn)
    res["recompute.grads"] = max(
        float((g - grads[n]).abs().max()) for n, g in grads_by_name(rec).items()
    )
    # ... and the same without replay differs (the perturbed routers route differently)
    free_eng = actor(hf_dir, replay=False, state=state)
    free_eng.forward_backward(mbs_p, loss_fn, den_fn)
    res["free.grads_differ"] = max(
        float((g - grads[n]).abs().max()) for n, g in grads_by_name(free_eng).items()
    )
    rl_step_with_replay(res, hf_dir, trajs, state)


def rl_step_with_replay(res, hf_dir, trajs, state):
    """The production RL step (``trainer.rl_step``: planning and packing from the trajectories,
    proximal forward, free-routing metrics, PPO update) on the perturbed actor. The session
    holds only what the step reads; its data source hands over the server's trajectories and
    weight publishing has no servers to reach."""
    from types import SimpleNamespace

    from areal_mega.config import load_config
    from areal_mega.rollout.routes import replay_layout
    from areal_mega.train.nonfinite import SkipGuard
    from areal_mega.trainer import rl_step

    cfg = load_config(
        None,
        [
            f"model.path={hf_dir}",
            "algorithm.routing_replay=r3",
            "algorithm.routing_replay_free_every=1",
            "rollout.n_samples=2",
        ],
    )
    trained = []
    # one poisonous sample joins the first group: its routes name an expert twice in one
    # token's top-k (they passed the shape/range checks; replaying them crashed the trainer)
    bad = trajs[0].token_extras["routed_experts"].copy()
    bad[len(bad) // 2, 0, 1] = bad[len(bad) // 2, 0, 0]
    poison = dataclass_replace(
        trajs[0], sample_id="poison", token_extras={**trajs[0].token_extras, "routed_experts": bad}
    )
    trajs = [trajs[0], poison, *trajs[1:]]
    session = SimpleNamespace(
        cfg=cfg,
        actor=actor(hf_dir, state=state),
        ref=None,
        critic=None,
        vision=None,
        mesh=ew.MESH[0],
        is_rank0=True,
        layout=dict(dp_size=1, tp_size=1, pp_size=1, cp_size=1),
        intake=SimpleNamespace(
            next_groups=lambda n: list(trajs),
            route_layout=replay_layout(cfg),
            quarantine=None,
            record_trained=lambda step, ids: trained.append(list(ids)),
        ),
        logger=SimpleNamespace(log_samples=lambda *a, **k: None),
        publish_weights=lambda version: None,
        skips=SkipGuard(3, routing_replay=True),
    )
    stats = rl_step(session, 1)
    res["step.stats"] = {
        k: v
        for k, v in stats.items()
        if k.startswith("moe/")
        or k in ("mismatch", "mismatch_tokens", "grad_norm", "n_samples")
        or k.startswith("refused/")
    }
    res["step.trained"] = trained


def dataclass_replace(mb, **kw):
    import dataclasses

    return dataclasses.replace(mb, **kw)


def scenario_layouts(res, work):
    ref = torch.load(work / "reference.pt", weights_only=False)
    HF[0] = hf = ref["hf"]
    mbs, world = ref["mbs"], int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    loss_fn, den_fn = policy_loss()
    layouts = [
        ("ep2", dict(dp=world, ep=world), False, None, None, rank),
        ("tp2sp", dict(tp=world), True, None, None, None),
        ("pp2_recompute", dict(pp=world), False, None, "full", None),
        ("pp2vpp2_recompute", dict(pp=world), False, 2, "full", None),
    ]
    for tag, dims, sp, vpp, recompute, share in layouts:
        set_mesh(dims, sp=sp, vpp=vpp)
        eng = actor(ref["hf_dir"], recompute=recompute, state=ref["state"])
        mine = mbs if share is None else mbs[share::world]
        want = ref["lps"] if share is None else ref["lps"][share::world]
        res[f"{tag}.logprobs"] = ew.compare_lps(eng.forward_logprobs(mine), want)
        eng.replay.reset_agreement()
        eng.forward_logprobs(mine, free_routing=True)
        res[f"{tag}.agreement"] = list(eng.replay.agreement())  # summed over the ranks
        stats = eng.forward_backward(mine, loss_fn, den_fn)
        res[f"{tag}.grads"], res[f"{tag}.grads_rel"] = ew.compare_grads(eng, ref, hf)
        res[f"{tag}.loss"] = abs(stats["loss"] - ref["loss"])


def set_mesh(spec, sp=False, vpp=None):
    """engine_worker's mesh holder, with virtual pipeline stages."""
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh

    if ew.MESH[0] is not None:
        ew.MESH[0].destroy()
    ew.MESH[0] = ParallelMesh.create(
        ParallelDims(**spec), sequence_parallel=sp, vpp=vpp, timeout_s=90
    )


def main():
    from pathlib import Path

    return ew.run_scenario(
        {
            "single": lambda res, d: scenario_single(res, Path(d)),
            "layouts": lambda res, d: scenario_layouts(res, Path(d)),
        }
    )


if __name__ == "__main__":
    sys.exit(main())
