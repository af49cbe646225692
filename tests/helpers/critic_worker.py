"""Critic checks in gloo processes, run by tests/test_critic_engine.py.

    python -m tests.helpers.critic_worker <scenario> <rank> <world> <port> <out_dir>

``layouts`` (2 ranks): a single-rank reference critic (TP1/PP1, plain autograd on the model,
the production value loss) against DP2, TP2, TP2+SP and PP2 (variable lengths): values and
gradients, as tests/helpers/engine_worker.py does for the actor (its shard mapping is reused), and
PP2 × VPP2 on a 4-layer model (variable lengths).
``single`` (1 rank): the GAE of a real RL step equals the torch reference on the same packed
batch; a critic restored from its checkpoint takes the same next step as an uninterrupted
one; an LM checkpoint loads into the trunk (fresh head), an HF ``score`` head into the head.
Rank r writes ``<out_dir>/<scenario>.<r>.json`` ({check: value}).
"""

import dataclasses
import os
import sys

import torch

from tests.helpers import engine_worker as ew

HF = ew.DENSE
RESULTS = {}  # this process's results (reference() adds its sanity numbers)
CRITIC = dict(lr=1e-3, value_clip=0.2, value_loss_coef=0.5)


def critic_engine(seed=7, hf=HF):
    """A critic on the current mesh with the test's critic settings (no grad clipping)."""
    from areal_mega.config import CriticConfig, ModelConfig, OptimizerConfig
    from areal_mega.engine.critic import CriticEngine, critic_optimizer_config

    ocfg = critic_optimizer_config(OptimizerConfig(clip_grad=0.0), CriticConfig(**CRITIC))
    return CriticEngine(
        ModelConfig(dtype="fp32"),
        hf_config=hf,
        mesh=ew.MESH[0],
        optimizer_cfg=ocfg,
        seed=seed,
        use_distributed_optimizer=False,
    )


def value_fns():
    from areal_mega.algo.value_loss import make_value_loss
    from areal_mega.config import CriticConfig

    return make_value_loss(CriticConfig(**CRITIC))


def reference(mbs, hf=HF):
    """TP1/PP1 critic: weights, values, value-loss gradients by plain autograd on the model
    (the DDP hooks accumulate into ``main_grad``, read back below). Attaches the loss's
    ``values`` (old, = current + noise) and ``returns`` to ``mbs``."""
    from areal_mega.engine.packed import block_causal_mask

    eng = critic_engine(hf=hf)
    model = eng.model[0].module
    state = {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if not k.endswith("_extra_state")
    }
    loss_fn, den_fn = value_fns()
    denom = float(sum(den_fn(mb) for mb in mbs))
    g = torch.Generator().manual_seed(5)
    vals, total = [], 0.0
    for c in eng.model:
        c.zero_grad_buffer()
    for mb in mbs:
        ids = mb["input_ids"].long()
        v = model(
            ids[None], mb["position_ids"][None], block_causal_mask(mb["segment_ids"].long())
        ).reshape(-1)
        in_seq = torch.zeros_like(v, dtype=torch.bool)
        for s, n in zip(mb["cu_seqlens_padded"][:-1].tolist(), mb["seqlens"].tolist()):
            in_seq[s : s + n] = True
        v = torch.where(in_seq, v, torch.zeros_like(v))
        mb["values"] = v.detach() + (torch.rand(v.shape, generator=g) - 0.5) * 0.6
        mb["returns"] = torch.rand(v.shape, generator=g)
        num, _ = loss_fn(v, None, mb)
        (num / denom).backward()
        total += float(num) / denom
        vals.append(v.detach())
    grads = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}
    RESULTS["ref.grad_norm"] = float(sum((g * g).sum() for g in grads.values())) ** 0.5
    RESULTS["ref.head_grad_norm"] = float(grads["output_layer.weight"].norm())
    return {"state": state, "lps": vals, "grads": grads, "loss": total, "n_tokens": denom}


def check(res, tag, ref, mbs, want=None, hf=HF):
    """Values, gradients and loss of the critic on the current mesh vs the reference."""
    eng = critic_engine(seed=99, hf=hf)  # other init: the reference weights are copied in
    ew.load_reference(eng, ref, hf)
    want = ref["lps"] if want is None else want
    res[f"{tag}.values"] = ew.compare_lps(eng.forward_values(mbs), want)
    stats = eng.forward_backward(mbs, *value_fns())
    res[f"{tag}.grads"], _ = ew.compare_grads(eng, ref, hf)
    res[f"{tag}.loss"] = abs(stats["loss"] - ref["loss"])
    return eng


def scenario_layouts(res, out_dir):
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    mbs = ew.make_mbs(1, [[9, 14, 5], [20, 3], [6, 6, 6, 4], [17]])
    ew.set_mesh(dict(dp=world))
    ref = reference(mbs)
    res["dp2.n_micro_batches"] = len(mbs[rank::world])
    check(res, "dp2", ref, mbs[rank::world], want=ref["lps"][rank::world])
    ew.set_mesh(dict(tp=world))
    check(res, "tp2", ref, mbs)
    ew.set_mesh(dict(tp=world), sp=True)
    check(res, "tp2sp", ref, mbs)
    ew.set_mesh(dict(pp=world))
    check(res, "pp2", ref, mbs)
    # interleaved pipeline (VPP 2) on a 4-layer model, variable lengths: the head sits on the
    # last chunk only; values, gradients and loss equal the reference.
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh

    hf4 = dict(HF, num_hidden_layers=4)
    var = ew.make_mbs(2, [[9, 14, 5], [31], [6, 6, 6, 10], [12, 3]])
    ew.set_mesh(dict(dp=world))
    ref4 = reference(var, hf4)
    ew.MESH[0].destroy()
    ew.MESH[0] = ParallelMesh.create(ParallelDims(pp=world), vpp=2, timeout_s=90)
    check(res, "pp2vpp2", ref4, var, hf=hf4)


# ----------------------------------------------------------------------------- single rank
def rl_micro_batches(cfg):
    """A real step's packed micro-batches (plan_step on trajectories with a truncated sample
    and a multi-turn loss mask), as PackedBatch objects with logprobs attached."""
    import numpy as np

    from areal_mega.dataplane.trajectory import Trajectory
    from areal_mega.train import batches

    rng = np.random.default_rng(3)
    trajs = []
    for i in range(8):
        n_p, n_g = 4 + i % 3, 5 + (i * 3) % 7
        t = Trajectory.from_tokens(
            rng.integers(0, ew.VOCAB, n_p),
            rng.integers(0, ew.VOCAB, n_g),
            -rng.random(n_g),
            np.zeros(n_g, np.int32),
            reward=float(i % 2),
            sample_id=f"s{i}",
            group_id=f"g{i // 4}",
            finish_reason="length" if i % 3 == 0 else "stop",
        )
        if i == 5:  # multi-turn: an environment span inside the completion
            t.loss_mask[n_p + 2 : n_p + 4] = 0
        trajs.append(t)
    plan = batches.plan_step(trajs, cfg, dp_size=1, tp_size=1, pp_size=1, cp_size=1)
    return plan.micro_batches[0]


def scenario_single(res, out_dir):
    from areal_mega.config import load_config
    from areal_mega.dataplane.trajectory import FINISH_REASONS
    from areal_mega.ops.reference import gae_loop_reference
    from areal_mega.train import batches
    from areal_mega.train.critic_step import gae_step, load_critic, save_critic, train_critic

    ew.set_mesh(dict(dp=1))
    cfg = load_config(
        None,
        [
            "algorithm.adv_estimator=gae",
            "critic.enabled=true",
            "algorithm.gamma=0.9",
            "algorithm.lam=0.8",
            "critic.bootstrap_truncated=true",
            "scheduler.max_tokens_per_mb=40",
            "critic.lr=1e-3",
        ],
    )
    mbs = rl_micro_batches(cfg)
    mbs = batches.attach(mbs, prox_logprobs=[mb["logprobs"] for mb in mbs])
    eng = critic_engine()
    out, stats = gae_step(eng, mbs, cfg, ew.MESH[0])
    worst = 0.0
    for mb in out:
        cu = mb["cu_seqlens_padded"].long()
        m = mb["loss_mask"].bool()
        v = mb["values"]
        r = torch.zeros_like(v)
        boot = torch.zeros(len(mb["seqlens"]))
        for b in range(len(mb["seqlens"])):
            idx = torch.nonzero(m[cu[b] : cu[b + 1]]).flatten()
            r[cu[b] + idx[-1]] = mb["rewards"][b]
            if int(mb["finish_codes"][b]) == FINISH_REASONS.index("length"):
                boot[b] = v[cu[b] + int(mb["seqlens"][b]) - 1]
        adv, ret = gae_loop_reference(
            r, v, cu, gamma=0.9, lam=0.8, bootstrap_values=boot, loss_mask=m
        )
        worst = max(
            worst,
            float((adv - mb["advantages"]).abs().max()),
            float((ret - mb["returns"]).abs().max()),
        )
    res["gae.max_diff"] = worst
    res["gae.n_micro_batches"] = len(out)
    length = FINISH_REASONS.index("length")
    res["gae.has_truncated"] = float(
        any(int(c) == length for mb in out for c in mb["finish_codes"])
    )
    res["gae.has_multiturn"] = float(
        any(
            bool(
                (mb["loss_mask"][1:].int() - mb["loss_mask"][:-1].int() == 1).sum()
                > len(mb["seqlens"])
            )
            for mb in out
        )
    )
    res["gae.stats_keys"] = sorted(stats)
    # KL in the reward: the penalty −β·KL_t enters the token rewards before GAE
    kl_cfg = dataclasses.replace(
        cfg,
        algorithm=dataclasses.replace(
            cfg.algorithm, kl_in_reward=True, kl_coef=0.5, kl_estimator="k1"
        ),
    )
    shifted = batches.attach(
        mbs, ref_logprobs=[mb["logprobs"] - 0.2 * mb["loss_mask"] for mb in mbs]
    )
    kl_out, kl_stats = gae_step(eng, shifted, kl_cfg, ew.MESH[0])
    res["kl.reward_mean"] = kl_stats["adv/kl_reward_mean"]
    res["kl.return_shift"] = max(
        float((a["returns"] - b["returns"]).abs().max()) for a, b in zip(kl_out, out)
    )
    # resume: two steps, checkpoint, third step; a fresh engine restored from the checkpoint
    # takes exactly the same third step
    root = os.path.join(out_dir, "ckpt")

    def step(e):
        new, _ = gae_step(e, mbs, cfg, ew.MESH[0])
        return train_critic(e, new, cfg)

    for _ in range(2):
        step(eng)
    save_critic(eng, root, 2, keep_last=2)
    s3 = step(eng)
    v3 = eng.forward_values(mbs)
    fresh = critic_engine(seed=123)
    load_critic(fresh, root, 2)
    r3 = step(fresh)
    res["resume.loss_diff"] = abs(s3["critic/loss"] - r3["critic/loss"])
    res["resume.values_diff"] = ew.compare_lps(fresh.forward_values(mbs), v3)
    res["resume.lr_equal"] = float(s3["critic/lr"] == r3["critic/lr"])
    res["resume.step_count"] = fresh.step_count
    # an LM checkpoint loads into the trunk; the head stays the fresh one
    lm_checks(res, out_dir, mbs)
    fit_checks(res, cfg)


def fit_checks(res, cfg):
    """The critic learns a value that depends on the generated prefix: R = 1 iff the second
    completion token is even, so V is predictable from that token on; explained variance
    rises over RL-like steps (values, GAE, value loss) on a fixed batch."""
    import numpy as np

    from areal_mega.dataplane.trajectory import Trajectory
    from areal_mega.train import batches
    from areal_mega.train.critic_step import gae_step, train_critic

    rng = np.random.default_rng(0)
    trajs = []
    for i in range(32):
        comp = rng.integers(0, 20, 6)
        trajs.append(
            Trajectory.from_tokens(
                rng.integers(0, 20, 6),
                comp,
                -rng.random(6),
                np.zeros(6, np.int32),
                reward=float(comp[1] % 2 == 0),
                sample_id=f"f{i}",
                group_id=f"h{i // 8}",
            )
        )
    mbs = batches.plan_step(trajs, cfg, dp_size=1, tp_size=1, pp_size=1, cp_size=1).micro_batches[0]
    mbs = batches.attach(mbs, prox_logprobs=[mb["logprobs"] for mb in mbs])
    eng = critic_engine(hf=ew.TIED)
    evs = []
    for _ in range(20):
        new, _ = gae_step(eng, mbs, cfg, ew.MESH[0])
        evs.append(train_critic(eng, new, cfg)["critic/explained_variance"])
    res["fit.ev_first"], res["fit.ev_last"] = evs[0], evs[-1]


def lm_checks(res, out_dir, mbs):
    from areal_mega.checkpoint.dist_ckpt import load_checkpoint
    from areal_mega.config import ModelConfig
    from areal_mega.engine import MegatronEngine
    from areal_mega.engine.critic import load_score_head
    from areal_mega.train.critic_step import init_critic

    lm = MegatronEngine(
        ModelConfig(dtype="fp32"), hf_config=ew.TIED, role="ref", mesh=ew.MESH[0], seed=31
    )
    lm_dir = os.path.join(out_dir, "lm")
    from areal_mega.checkpoint.dist_ckpt import save_checkpoint

    save_checkpoint(lm_dir, 0, lm.model_chunks())
    critic = critic_engine(seed=5, hf=ew.TIED)
    head0 = critic.head_parameter().detach().clone()
    hf_dir = os.path.join(out_dir, "hf")
    os.makedirs(hf_dir, exist_ok=True)
    init_critic(
        critic,
        lambda views, hf: load_checkpoint(lm_dir, views, load_optimizer=False, load_rng=False),
        hf_dir,
    )
    lm_sd = lm.model_chunks()[0].state_dict()
    diff = 0.0
    for k, v in critic.model_chunks()[0].state_dict().items():
        if k.startswith("output_layer") or k.endswith("_extra_state"):
            continue
        diff = max(diff, float((v - lm_sd[k]).abs().max()))
    res["lm.trunk_diff"] = diff
    res["lm.head_unchanged"] = float(torch.equal(critic.head_parameter().detach(), head0))
    from safetensors.torch import save_file

    score = torch.randn(1, ew.TIED["hidden_size"])
    save_file({"score.weight": score}, os.path.join(hf_dir, "model.safetensors"))
    res["score.loaded"] = float(load_score_head(critic, hf_dir))
    res["score.head_diff"] = float((critic.head_parameter().detach() - score).abs().max())
    bad = torch.randn(2, ew.TIED["hidden_size"])
    save_file({"score.weight": bad}, os.path.join(hf_dir, "model.safetensors"))
    try:
        load_score_head(critic, hf_dir)
        res["score.bad_shape_error"] = ""
    except ValueError as e:
        res["score.bad_shape_error"] = str(e)


def main():
    return ew.run_scenario({"layouts": scenario_layouts, "single": scenario_single}, RESULTS)


if __name__ == "__main__":
    sys.exit(main())
