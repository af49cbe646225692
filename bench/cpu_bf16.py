"""bf16 against fp32 on this CPU: the trainer's GEMMs and one GRPO trainer step, in one run.

Usage (from the repository root; a couple of minutes on 2 cores)::

    python bench/cpu_bf16.py                  # matmuls, tiny step, 135M shape with 4 layers
    python bench/cpu_bf16.py --layers 30      # the whole 135M model (much longer)
    python bench/cpu_bf16.py --profile        # + the top ops of one 135M-shape step per dtype

Printed first: the CPU's model name, its bf16 ISA (``avx512_bf16``, ``amx_bf16`` from
``/proc/cpuinfo``), torch's CPU capability and the thread count.

Matmuls: the three products of megatron's tensor-parallel linear layers as the trainer calls
them (:mod:`areal_mega.compat.cpu_gemm`: forward ``x @ W^T``, input gradient ``dY @ W``,
weight gradient ``dY^T @ X``) at the 135M Llama shape's layers (:data:`bench.engine.SHAPE`:
hidden 576, q/k/v 960, gate+up 3,072, down 1,536 -> 576, the tied output layer 49,152) for
``--tokens`` tokens (the recipe's micro-batch, 512), GFLOP/s of fp32 and of bf16 and their
ratio. Best of ``--repeats`` after one warm-up.

Attention: forward+backward of ``F.scaled_dot_product_attention`` on bf16 inputs at the shapes
of a GRPO micro-batch's shared-prefix units and of longer sequences, torch's bf16 CPU kernel
against the same call on fp32 copies (what :func:`areal_mega.models.varlen_attention.attention`
does for queries up to ``CPU_FP32_ATTENTION_MAX_QUERY``): process CPU milliseconds, medians of
interleaved runs (CPU time, not wall: robust to other jobs on a shared machine).

Trainer step: :func:`bench.grpo_step.grpo_step` (the compute of one ``trainer.rl_step`` on one
rank: planning, forward/backward, the megatron optimizer step) with ``model.dtype`` fp32 and
then bf16, each in its own process built the way the trainer's session builds the actor
(``recipes/tiny-cpu.yaml``), on two models: the recipe's tiny model (hidden 128, 2 layers,
22-token vocabulary) and the 135M shape with ``--layers`` layers; random weights, one warm-up
step, then ``--steps`` steps; the best wall and process-CPU seconds and the ratio fp32/bf16 of
the wall times (> 1: bf16 is faster). On a shared machine single figures are noisy (the load
average is printed first).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import SHAPE  # noqa: E402  (bench/ is a namespace package)

# the recipe's tiny model (recipes/tiny-cpu.yaml, tools/make_tiny_model.py --charset digits)
TINY = dict(
    SHAPE,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=256,
    vocab_size=22,
)
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512f")


def cpu_description() -> str:
    """``model name; bf16 ISA flags present; torch capability``."""
    import torch

    name, flags = platform.processor() or "?", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    have = [f for f in BF16_FLAGS if f in flags] or ["none of " + ", ".join(BF16_FLAGS)]
    return (
        f"{name}; ISA: {', '.join(have)}; torch {torch.__version__} CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, oneDNN "
        f"{'on' if torch.backends.mkldnn.is_available() else 'off'}"
    )


def gemm_shapes(tokens: int) -> list:
    """``(layer, M, K, N)`` of the 135M shape's linear layers (fused q/k/v and gate/up)."""
    h, ffn, heads, kv = (
        SHAPE[k]
        for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    )
    d = h // heads
    return [
        ("qkv", tokens, h, (heads + 2 * kv) * d),
        ("proj", tokens, heads * d, h),
        ("fc1", tokens, h, 2 * ffn),
        ("fc2", tokens, ffn, h),
        ("output", tokens, h, SHAPE["vocab_size"]),
    ]


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_gemms(tokens: int, repeats: int) -> None:
    """Print GFLOP/s of the trainer's three GEMMs per layer shape, fp32 against bf16."""
    import torch

    from areal_mega.compat import cpu_gemm

    print(
        f"\nmatmuls (areal_mega.compat.cpu_gemm as megatron's linear layers call them; "
        f"M = {tokens} tokens; GFLOP/s, best of {repeats})"
    )
    print(
        f"  {'layer':8s}{'M x K x N':>20s}{'product':>9s}{'fp32':>9s}{'bf16':>9s}{'bf16/fp32':>11s}"
    )
    totals = {torch.float32: 0.0, torch.bfloat16: 0.0}
    flops_all = 0
    for layer, m, k, n in gemm_shapes(tokens):
        flops = 2.0 * m * k * n
        g = torch.Generator().manual_seed(0)
        base = dict(
            x=torch.randn(m, k, generator=g),
            w=torch.randn(n, k, generator=g) * 0.02,
            dy=torch.randn(m, n, generator=g),
        )
        for prod in ("fwd", "dgrad", "wgrad"):
            rate = {}
            for dt in (torch.float32, torch.bfloat16):
                x, w, dy = (t.to(dt) for t in base.values())
                fn = {
                    "fwd": lambda x=x, w=w: cpu_gemm.linear(x, w),
                    "dgrad": lambda dy=dy, w=w: cpu_gemm.grad_input(dy, w),
                    "wgrad": lambda dy=dy, x=x: cpu_gemm.grad_weight(dy, x),
                }[prod]
                s = _best(fn, repeats)
                totals[dt] += s
                rate[dt] = flops / s / 1e9
            flops_all += flops
            print(
                f"  {layer:8s}{f'{m}x{k}x{n}':>20s}{prod:>9s}{rate[torch.float32]:9.1f}"
                f"{rate[torch.bfloat16]:9.1f}{rate[torch.bfloat16] / rate[torch.float32]:10.2f}x"
            )
    f32, b16 = (flops_all / totals[dt] / 1e9 for dt in (torch.float32, torch.bfloat16))
    print(
        f"  all products of one layer set: fp32 {f32:.1f}, bf16 {b16:.1f} GFLOP/s "
        f"({b16 / f32:.2f}x)"
    )


# [b, heads, queries, keys] of SDPA calls: a GRPO micro-batch's padded shared-prefix units
# (16 and 8 answers of ~50 tokens seeing a 30-token prompt, 9 query / 3 KV heads), around
# the fp32 cut-off (areal_mega.models.varlen_attention.CPU_FP32_ATTENTION_MAX_QUERY) and a
# long causal sequence
ATTENTION_SHAPES = (
    (16, 51, 80, "mask"),
    (8, 53, 82, "mask"),
    (4, 128, 128, "mask"),
    (1, 160, 160, "causal"),
    (1, 256, 256, "causal"),
    (1, 2048, 2048, "causal"),
)


def bench_attention(repeats: int, threads: int) -> None:
    """Print the CPU time of SDPA forward+backward on bf16 inputs: torch's bf16 kernel against
    the same call on fp32 copies (casts included), interleaved, medians; with 1 thread and
    with ``threads``."""
    import statistics

    import torch
    import torch.nn.functional as F

    from areal_mega.models.varlen_attention import CPU_FP32_ATTENTION_MAX_QUERY

    print(
        f"\nattention (SDPA forward+backward of bf16 q, k, v: 9 query / 3 KV heads of 64; "
        f"process CPU ms, median of {repeats} interleaved; the trainer takes fp32 copies up "
        f"to {CPU_FP32_ATTENTION_MAX_QUERY} queries)"
    )
    print(
        f"  {'b x queries x keys':26s}{'threads':>8s}{'bf16 kernel':>12s}{'fp32 copies':>12s}"
        f"{'bf16/fp32':>11s}"
    )
    g = torch.Generator().manual_seed(0)
    for b, lq, lk, kind in ATTENTION_SHAPES:
        q0, k0, v0 = (torch.randn(b, h, n, 64, generator=g) for h, n in ((9, lq), (3, lk), (3, lk)))
        mask = None
        if kind == "mask":  # the units' mask: the prompt, then causal
            mask = (torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + lk - lq)[None, None]
        dout = torch.randn(b, 9, lq, 64, generator=g).bfloat16()

        def run(up, q0=q0, k0=k0, v0=v0, mask=mask, dout=dout):
            q, k, v = (x.bfloat16().requires_grad_() for x in (q0, k0, v0))
            a = (q.float(), k.float(), v.float()) if up else (q, k, v)
            o = F.scaled_dot_product_attention(
                *a, attn_mask=mask, is_causal=mask is None, scale=0.125, enable_gqa=True
            )
            o.to(torch.bfloat16).backward(dout)

        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            times = {False: [], True: []}
            run(False), run(True)
            for i in range(repeats):
                for up in (False, True) if i % 2 else (True, False):
                    c0 = time.process_time()
                    run(up)
                    times[up].append(time.process_time() - c0)
            bf, fp = (statistics.median(times[up]) * 1e3 for up in (False, True))
            print(
                f"  {f'{b} x {lq} x {lk} ({kind})':26s}{n_threads:8d}{bf:12.2f}{fp:12.2f}"
                f"{bf / fp:10.2f}x"
            )
    torch.set_num_threads(threads)
    print(
        "  (> 1: the fp32 copies are cheaper; on a loaded machine the CPU time of more than "
        "one thread includes their waits for each other, the 1-thread figure is the work)"
    )


def child(args, hf_dir, dtype, out) -> None:
    """One trainer-step variant in this process: build the actor at ``dtype``, load the
    weights of ``hf_dir``, one warm-up step, ``--steps`` timed steps."""
    import torch

    from areal_mega.checkpoint.convert import _single_process_mesh
    from areal_mega.common.malloc import set_training_policy
    from areal_mega.config import load_config
    from areal_mega.engine import MegatronEngine
    from bench.engine import load_hf_weights
    from bench.grpo_step import grpo_step, make_trajectories

    set_training_policy()  # the trainer's malloc policy on CPU
    torch.set_num_threads(args.threads)
    vocab = json.loads((Path(hf_dir) / "config.json").read_text())["vocab_size"]
    with tempfile.TemporaryDirectory(prefix="bench_bf16_run_") as run_dir:
        cfg = load_config(
            ROOT / "recipes" / "tiny-cpu.yaml",
            [
                f"model.path={hf_dir}",
                f"model.dtype={dtype}",
                f"logging.run_dir={run_dir}",
                f"rollout.batch_size={args.prompts}",
                f"rollout.n_samples={args.group}",
                f"rollout.max_new_tokens={args.max_new}",
            ],
        )
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
    actor.optimizer.reload_model_params()  # bf16: the fp32 main params copy the loaded weights
    targs = argparse.Namespace(
        prompts=args.prompts, group=args.group, max_new=args.max_new, prompt_len=args.prompt_len
    )
    grpo_step(actor, mesh, cfg, make_trajectories(targs, vocab, 0, 0), 0)  # warm-up
    steps = [
        grpo_step(actor, mesh, cfg, make_trajectories(targs, vocab, i, i), i)
        for i in range(1, args.steps + 1)
    ]
    table = None
    if args.profile_child:
        from bench.grpo_step import profile_table

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            grpo_step(actor, mesh, cfg, make_trajectories(targs, vocab, 99, 99), args.steps + 1)
        table = profile_table(prof, top=15)[0]
    mesh.destroy(process_group=True)
    Path(out).write_text(json.dumps({"steps": steps, "table": table}))


def run_step_variant(args, hf_dir, dtype, tmp, profile=False) -> dict:
    out = Path(tmp) / f"{Path(hf_dir).name}-{dtype}.json"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        str(hf_dir),
        dtype,
        str(out),
        f"--threads={args.threads}",
        f"--steps={args.steps}",
        f"--prompts={args.prompts}",
        f"--group={args.group}",
        f"--max-new={args.max_new}",
        f"--prompt-len={args.prompt_len}",
    ] + (["--profile-child"] if profile else [])
    env = dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode or not out.exists():
        sys.exit(f"{dtype} step on {hf_dir} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def bench_steps(args, tmp) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    print(
        f"\ntrainer step (bench/grpo_step.py's grpo_step: plan, forward/backward, optimizer; "
        f"{args.prompts} prompts x {args.group} samples, prompt {args.prompt_len} tokens, "
        f"completion 1-{args.max_new}; 1 warm-up + {args.steps} steps, wall seconds)"
    )
    print(
        f"  {'model':26s}{'tokens':>8s}{'fp32 best':>11s}{'bf16 best':>11s}{'fp32 CPU':>10s}"
        f"{'bf16 CPU':>10s}{'fp32/bf16':>11s}"
    )
    models = [
        ("tiny (recipe)", TINY),
        (f"135M shape, {args.layers} layers", dict(SHAPE, num_hidden_layers=args.layers)),
    ]
    for name, shape in models:
        hf = Path(tmp) / name.split()[0]
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(hf)
        res = {dt: run_step_variant(args, hf, dt, tmp)["steps"] for dt in ("fp32", "bf16")}
        best = {dt: min(st["total_s"] for st in steps) for dt, steps in res.items()}
        cpu = {dt: min(st["cpu_s"] for st in steps) for dt, steps in res.items()}
        print(
            f"  {name:26s}{res['fp32'][0]['tokens']:8.0f}{best['fp32']:11.3f}"
            f"{best['bf16']:11.3f}{cpu['fp32']:10.2f}{cpu['bf16']:10.2f}"
            f"{best['fp32'] / best['bf16']:10.2f}x"
        )
    print(
        "  (best of the steps: wall seconds and process CPU seconds; fp32/bf16 of the best "
        "wall times, > 1: bf16 is faster)"
    )
    if args.profile:
        for dtype in ("fp32", "bf16"):
            res = run_step_variant(args, Path(tmp) / "135M", dtype, tmp, profile=True)
            print(f"\n  {dtype} 135M-shape step, top ops by self CPU time:\n{res['table']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512, help="M of the matmuls")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4, help="layers of the 135M-shape model")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--max-new", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="+ one profiled step per dtype")
    ap.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", nargs=3, metavar=("HF_DIR", "DTYPE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args, *args.child)
    import torch

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}; {args.threads} threads")
    print(f"load average (1, 5, 15 min): {os.getloadavg()} on {os.cpu_count()} CPUs")
    bench_gemms(args.tokens, args.repeats)
    bench_attention(max(args.repeats, 5), args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_bf16_") as tmp:
        bench_steps(args, tmp)


if __name__ == "__main__":
    sys.exit(main())
