"""One real GRPO trainer step on CPU, timed and profiled: oneDNN against torch's matmul (MKL).

Usage (from the repository root)::

    python bench/grpo_step.py                        # 135M shape, both GEMM variants
    python bench/grpo_step.py --layers 2 --steps 1   # quick look
    python bench/grpo_step.py --gemm torch --threads 2 --prompts 4 --group 8 --max-new 60

Model: the shape of a 135M Llama (hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536,
vocabulary 49,152, tied embeddings; :data:`bench.engine.SHAPE`), random weights, fp32. The
parent writes one HF checkpoint (``save_pretrained``); each variant's process builds the
actor ``MegatronEngine`` the way the trainer's session does (``cfg.model``,
``cfg.optimizer``, ``cfg.actor`` of ``recipes/tiny-cpu.yaml`` with ``model.path`` set to that
checkpoint) and loads the weights through :mod:`areal_mega.checkpoint.hf_mapping`.

Batch: what the intake hands a step: ``--prompts`` groups of ``--group`` trajectories
(:class:`~areal_mega.dataplane.trajectory.Trajectory`, ``from_tokens``), a random prompt of
``--prompt-len`` tokens per group and a random completion of 1..``--max-new`` tokens per
sample, random 0/1 rewards, behaviour logprobs near -ln V (a random model's), version = the
step's weight version. A fresh batch per step (its own seed).

Step: exactly the compute of :func:`areal_mega.trainer.rl_step` on one rank:
``batches.plan_step`` (GRPO advantages, micro-batch planning and packing with the recipe's
``scheduler.max_tokens_per_mb``), ``batches.distribute``, the proximal logprobs where the trainer
computes them
(``trainer.prox_forward_needed``; ``--prox``: ``actor.prox_logprobs``, ``both`` compares
auto with recompute), ``make_policy_loss`` and
``actor.train_batch`` per ``batches.minibatches`` (forward, backward, optimizer step).
Left out: the intake's wait for rollouts (there are no rollout servers), the reference
model (off in the recipe) and the weight publication to the servers (``publish_weights``).

Measured: one warm-up step, then ``--steps`` steps; per step the planning, logprob-recompute
and train (forward+backward+optimizer) seconds, the total and tokens/s (all tokens of the
batch over the total; CPU s: the process's CPU time). Then one more step under ``torch.profiler``:
the top 12 ops by self
CPU time and the share of the matmul-type ops (mm, addmm, bmm, matmul, oneDNN's
``_linear_pointwise``) in the total self CPU time. Each ``--gemm`` variant runs in its own
process (``AREAL_MEGA_CPU_GEMM``, see :mod:`areal_mega.compat.cpu_gemm`) with
``torch.set_num_threads(--threads)``; with both, the ratio torch/onednn of the best and of
the mean step time is printed (> 1: oneDNN is faster).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import SHAPE, load_hf_weights  # noqa: E402  (bench/ is a namespace package)

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "mkldnn::_linear_pointwise")
LAYOUT = dict(dp_size=1, tp_size=1, pp_size=1, cp_size=1)


def make_trajectories(args, vocab, seed, version):
    """``--prompts`` x ``--group`` finished trajectories as the intake delivers them."""
    import numpy as np

    from areal_mega.dataplane.trajectory import Trajectory

    rng = np.random.default_rng(seed)
    trajs = []
    for p in range(args.prompts):
        prompt = rng.integers(3, vocab, args.prompt_len)
        for k in range(args.group):
            n = int(rng.integers(1, args.max_new + 1))
            trajs.append(
                Trajectory.from_tokens(
                    # behaviour logprobs near a random model's (-ln V), so the importance weights
                    # and the loss are those of a near on-policy step
                    prompt,
                    rng.integers(3, vocab, n),
                    -np.log(vocab) + rng.normal(0.0, 0.05, n),
                    np.full(n, version),
                    reward=float(rng.integers(0, 2)),
                    sample_id=f"s{seed}-{p}-{k}",
                    group_id=f"g{seed}-{p}",
                    created_at=0.0,
                ).validate()
            )
    return trajs


def load_cfg(args, hf_dir, run_dir):
    """``recipes/tiny-cpu.yaml`` pointed at the benchmark's model and batch shape."""
    from areal_mega.config import load_config

    overrides = [
        f"model.path={hf_dir}",
        f"logging.run_dir={run_dir}",
        f"rollout.batch_size={args.prompts}",
        f"rollout.n_samples={args.group}",
        f"rollout.max_new_tokens={args.max_new}",
    ]
    if args.mb_tokens:
        overrides.append(f"scheduler.max_tokens_per_mb={args.mb_tokens}")
    overrides.append(f"actor.share_prompt_prefix={args.share_prefix == 'on'}")
    if args.prox in ("auto", "recompute"):
        overrides.append(f"actor.prox_logprobs={args.prox}")
    return load_config(ROOT / "recipes" / "tiny-cpu.yaml", overrides)


def grpo_step(actor, mesh, cfg, trajs, version, before_optimizer=None):
    """rl_step's compute on ``trajs`` (weights of ``version``); returns times and stats.
    ``before_optimizer()``, when given, runs after each backward, before its optimizer step
    (``train_batch`` is the two halves: ``forward_backward`` then ``optimizer_step``)."""
    from areal_mega.algo import finalize_stats, make_policy_loss
    from areal_mega.train import batches
    from areal_mega.trainer import prox_forward_needed

    t0, c0 = time.perf_counter(), time.process_time()
    plan = batches.plan_step(trajs, cfg, **LAYOUT, share_prefix=actor.shares_prompt_prefix)
    batch = batches.distribute(plan, mesh)
    t_data = time.perf_counter()
    mbs = batch.micro_batches
    mbs = batches.attach(mbs, policy_version=[version] * len(mbs))
    updates = batches.minibatches(
        list(range(len(mbs))), cfg.actor.ppo_n_minibatches, actor.micro_batch_multiple
    )
    recompute = prox_forward_needed(cfg, version + 1, len(updates))
    if recompute:
        mbs = batches.attach(
            mbs, prox_logprobs=actor.forward_logprobs(mbs, temperature=cfg.actor.temperature)
        )
    t_fwd = time.perf_counter()
    loss_fn, denominator_fn = make_policy_loss(
        cfg.algorithm, max_response_len=cfg.rollout.max_new_tokens, prox_from_forward=not recompute
    )
    train_stats = []
    for indices in updates:
        train_stats.append(
            actor.forward_backward(
                [mbs[i] for i in indices],
                loss_fn,
                denominator_fn,
                return_entropy=True,
                temperature=cfg.actor.temperature,
            )
        )
        if before_optimizer is not None:
            before_optimizer()
        train_stats[-1].update(actor.optimizer_step())
    t_train = time.perf_counter()
    stats = {**batch.stats, **batches.merge_train_stats(train_stats, finalize_stats)}
    return {
        "plan_s": t_data - t0,
        "logprobs_s": t_fwd - t_data,
        "train_s": t_train - t_fwd,
        "total_s": t_train - t0,
        "cpu_s": time.process_time() - c0,
        "tokens": stats["n_tokens_total"],
        "micro_batches": stats["n_micro_batches"],
        "loss": stats["loss"],
        "grad_norm": stats["grad_norm"],
    }


def profile_table(prof, top=12):
    """(text table of the ``top`` ops by self CPU time, matmul-type share of the total)."""
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows) or 1.0
    mm = sum(e.self_cpu_time_total for e in rows if e.key in MATMUL_OPS)
    lines = [f"    {'op':56s}{'self CPU s':>11s}{'share':>8s}{'calls':>8s}"]
    for e in rows[:top]:
        lines.append(
            f"    {e.key[:55]:56s}{e.self_cpu_time_total / 1e6:11.3f}"
            f"{e.self_cpu_time_total / total:8.1%}{e.count:8d}"
        )
    return "\n".join(lines), mm / total


def child(args, hf_dir, out):
    """One variant (``AREAL_MEGA_CPU_GEMM`` already set by the parent): build, warm up, time."""
    import torch

    from areal_mega.checkpoint.convert import _single_process_mesh
    from areal_mega.common.malloc import set_training_policy
    from areal_mega.compat import cpu_gemm
    from areal_mega.engine import MegatronEngine

    set_training_policy()  # the trainer's malloc policy on CPU
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_grpo_run_") as run_dir:
        cfg = load_cfg(args, hf_dir, run_dir)
    mesh = _single_process_mesh()
    torch.manual_seed(cfg.seed)
    actor = MegatronEngine(
        cfg.model,
        role="actor",
        mesh=mesh,
        optimizer_cfg=cfg.optimizer,
        actor_cfg=cfg.actor,
        seed=cfg.seed,
        total_train_steps=cfg.total_steps,
    )
    load_hf_weights(actor, hf_dir)
    vocab = SHAPE["vocab_size"]
    grpo_step(actor, mesh, cfg, make_trajectories(args, vocab, args.seed, 0), 0)  # warm-up
    steps = [
        grpo_step(actor, mesh, cfg, make_trajectories(args, vocab, args.seed + i, i), i)
        for i in range(1, args.steps + 1)
    ]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        profiled = grpo_step(
            actor,
            mesh,
            cfg,
            make_trajectories(args, vocab, args.seed + args.steps + 1, args.steps + 1),
            args.steps + 1,
        )
    table, mm_share = profile_table(prof)
    mesh.destroy(process_group=True)
    Path(out).write_text(
        json.dumps(
            {
                "onednn_active": cpu_gemm._AVAILABLE,
                "steps": steps,
                "profiled": profiled,
                "table": table,
                "mm_share": mm_share,
                "threads": torch.get_num_threads(),
            }
        )
    )


def run_variant(gemm, prox, args, hf_dir, tmp):
    """Run :func:`child` in a fresh process with ``AREAL_MEGA_CPU_GEMM=gemm`` and
    ``actor.prox_logprobs=prox``."""
    out = Path(tmp) / f"{gemm}-{prox}.json"
    flags = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("child", "gemm", "prox") and v is not None
    ] + [f"--prox={prox}"]
    cmd = [sys.executable, __file__, "--child", hf_dir, str(out)] + flags
    env = dict(os.environ, PYTHONWARNINGS="ignore", AREAL_MEGA_CPU_GEMM=gemm)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode or not out.exists():
        sys.exit(f"{gemm} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def report(gemm, prox, res):
    """Print one variant's per-step split and its profile."""
    print(
        f"\n== AREAL_MEGA_CPU_GEMM={gemm}, actor.prox_logprobs={prox} "
        f"(oneDNN linear active: {res['onednn_active']}, "
        f"{res['threads']} threads)"
    )
    print(
        f"  {'step':6s}{'tokens':>8s}{'mbs':>5s}{'plan s':>9s}{'logprobs s':>12s}"
        f"{'train s':>9s}{'total s':>9s}{'CPU s':>8s}{'tokens/s':>10s}{'loss':>10s}"
    )
    for i, st in enumerate(res["steps"] + [res["profiled"]], 1):
        name = "prof" if i > len(res["steps"]) else str(i)
        print(
            f"  {name:6s}{st['tokens']:8.0f}{st['micro_batches']:5.0f}{st['plan_s']:9.3f}"
            f"{st['logprobs_s']:12.2f}{st['train_s']:9.2f}{st['total_s']:9.2f}{st['cpu_s']:8.1f}"
            f"{st['tokens'] / st['total_s']:10.1f}{st['loss']:10.4f}"
        )
    print(
        f"  profile of the 'prof' step (top 12 ops by self CPU time; the profiler adds "
        f"overhead):\n{res['table']}"
    )
    print(
        f"  matmul-type ops ({', '.join(o.split('::')[1] for o in MATMUL_OPS)}): "
        f"{res['mm_share']:.1%} of the self CPU time"
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--prompts", type=int, default=4, help="prompt groups per step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--max-new", type=int, default=60, help="completion 1..max-new tokens")
    ap.add_argument(
        "--mb-tokens",
        type=int,
        default=None,
        help="scheduler.max_tokens_per_mb (default: the recipe's)",
    )
    ap.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gemm", choices=("onednn", "torch", "both"), default="both")
    ap.add_argument(
        "--prox",
        choices=("auto", "recompute", "both"),
        default="auto",
        help="actor.prox_logprobs; both: compare them (first --gemm variant)",
    )
    ap.add_argument(
        "--share-prefix",
        choices=("on", "off"),
        default="on",
        help="actor.share_prompt_prefix: a group's prompt computed once",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--child", nargs=2, metavar=("HF_DIR", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args, *args.child)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    gemms = ("onednn", "torch") if args.gemm == "both" else (args.gemm,)
    proxes = ("auto", "recompute") if args.prox == "both" else (args.prox,)
    variants = [(g, proxes[0]) for g in gemms] + [(gemms[0], p) for p in proxes[1:]]
    print(
        f"model: 135M Llama shape, {args.layers} layers, fp32, {args.threads} threads; "
        f"batch: {args.prompts} prompts x {args.group} samples, prompt {args.prompt_len} "
        f"tokens, completion 1-{args.max_new}, shared prompts {args.share_prefix}; one "
        f"warm-up step + {args.steps} measured + "
        f"one profiled; no rollout servers, no weight publication"
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_grpo_") as tmp:
        torch.manual_seed(args.seed)
        LlamaForCausalLM(LlamaConfig(**dict(SHAPE, num_hidden_layers=args.layers))).save_pretrained(
            tmp
        )
        for gemm, prox in variants:
            results[gemm, prox] = run_variant(gemm, prox, args, tmp, tmp)
            report(gemm, prox, results[gemm, prox])
    pairs = []
    if len(gemms) == 2:
        pairs.append((("torch", proxes[0]), ("onednn", proxes[0])))
    if len(proxes) == 2:
        pairs.append(((gemms[0], "recompute"), (gemms[0], "auto")))
    for slow, fast in pairs:
        print()
        for name, agg in (("best", min), ("mean", lambda v: sum(v) / len(v))):
            tot, r = {}, {}
            for key in ("total_s", "train_s", "cpu_s"):
                vals = {v: agg([s[key] for s in results[v]["steps"]]) for v in (slow, fast)}
                tot[key], r[key] = vals, vals[slow] / vals[fast]
            print(
                f"{name} step: {'/'.join(fast)} {tot['total_s'][fast]:.2f} s, "
                f"{'/'.join(slow)} {tot['total_s'][slow]:.2f} s; ratio = "
                f"{r['total_s']:.2f}x (train part {r['train_s']:.2f}x, CPU seconds "
                f"{r['cpu_s']:.2f}x; > 1: {'/'.join(fast)} is faster)"
            )
    if pairs:
        print(
            "(on a shared machine single steps are noisy: the best step is the fairer "
            "figure; check `uptime`)"
        )


if __name__ == "__main__":
    sys.exit(main())
