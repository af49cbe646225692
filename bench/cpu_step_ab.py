"""The CPU fast paths of a trainer step against the code they replaced, interleaved in one run.

Usage (from the repository root; a few minutes on 2 cores)::

    python bench/cpu_step_ab.py                       # fp32 and bf16, every change
    python bench/cpu_step_ab.py --dtype bf16 --change attention_fp32 --pairs 8

One process per dtype builds the actor the way :mod:`bench.cpu_bf16` does (``recipes/tiny-cpu
.yaml``, the 135M Llama shape with ``--layers`` layers, random weights) and runs
:func:`bench.grpo_step.grpo_step` in pairs: the step with the change (B) and the step with the
former code restored (A), in alternating order, each pair on the same fresh batch; the median
over pairs of A/B is the figure to read (> 1: the change is faster). Wall seconds and process
CPU seconds are both reported. On a machine shared with other jobs even these ratios swing by
tens of percent with 2 threads (a thread waiting for its descheduled partner at every parallel
region); ``--threads 1`` and the CPU seconds are the steadiest measure of the work a change
saves (a no-op change, e.g. ``attention_fp32`` in fp32, shows the noise left).

Changes (``--change``; each B is the code as it is, each A puts the former code back for the
step):

* ``finite``: the non-finite gradient check before the optimizer step
  (:func:`areal_mega.engine.finite.all_finite`, one ``aminmax`` pass) against
  ``torch.isfinite(g).all()``;
* ``attention_fp32``: bf16 attention of short queries on fp32 copies
  (:data:`areal_mega.models.varlen_attention.CPU_FP32_ATTENTION_MAX_QUERY`) against torch's bf16
  kernel (no-op in fp32);
* ``unit_families``: the answers of a GRPO group side by side in one entry of the padded
  attention batch where that costs less (:func:`areal_mega.models.varlen_attention.batch_entries`)
  against one entry per answer;
* ``grad_in_logits``: the log-probabilities' backward writing the gradient over the output
  layer's logits (:func:`areal_mega.ops.logits_read_by_loss_only`) against a new buffer;
* ``width_batches``: the shared-prefix attention's entries in padded batches cut by width
  (:func:`areal_mega.models.varlen_attention.split_batches`) against the former choice of one
  padded batch, or one call per answer where that batch would cost over 4x the answers' area;
* ``wgrad_fp32``: bf16 weight gradients summed in fp32 by one GEMM straight into the main
  gradient (:func:`areal_mega.compat.main_grad.fused_bf16_available`; where oneDNN has bf16
  GEMMs) against the bf16 product added (in pieces for the large ones; no-op in fp32);
* ``reused_output``: the bf16 forward products over glibc's mmap ceiling (the output layer's
  logits) written into a reused buffer (:class:`areal_mega.compat.cpu_gemm.ReusedOutput`)
  against a new tensor each time (no-op in fp32);
* ``bf16_widened``: on a CPU without bf16 GEMMs (AVX2 only), bf16 products computed in fp32
  from the widened operands (:mod:`areal_mega.common.cpu_bf16`) against torch's bf16 products
  (``AREAL_MEGA_CPU_BF16_GEMM=native``; a scalar loop there: minutes a step at 8 layers; no-op
  in fp32 and where the CPU has bf16 GEMMs);
* ``all``: every change at once.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engine import SHAPE  # noqa: E402  (bench/ is a namespace package)

CHANGES = (
    "finite",
    "attention_fp32",
    "grad_in_logits",
    "width_batches",
    "unit_families",
    "wgrad_fp32",
    "reused_output",
    "bf16_widened",
)


def _former_entries_and_batches(va):
    """The shared-prefix attention's former planning: one padded batch of entries, or a call
    per unit where padding would cost over 4x the units' own area (fewer than 4: always)."""

    def own_area(u):
        return u[1] * (u[3] + u[1])

    def one_call_each(units):
        wq, wk = max(u[1] for u in units), max(u[3] + u[1] for u in units)
        return len(units) < 4 or len(units) * wq * wk > 4.0 * sum(map(own_area, units))

    def padded_cost(entries):
        lens, spans = va._entry_widths(entries)
        return len(entries) * (max(lens) * max(spans) + va.ENTRY_AREA)

    def batch_entries(units):
        families = {}
        for u in units:
            families.setdefault((u[2], u[3]), []).append(u)
        singles = [[u] for u in units]
        if not units[0][3] or len(families) == len(units):
            return singles
        if one_call_each(units):
            alone = sum(own_area(u) + va.CALL_AREA for u in units)
        else:
            alone = padded_cost(singles)
        grouped = list(families.values())
        return grouped if padded_cost(grouped) < alone else singles

    def split_batches(entries):
        units = [u for e in entries for u in e]
        if len(entries) == len(units) and one_call_each(units):
            return [[e] for e in entries]
        return [entries]

    return batch_entries, split_batches


@contextlib.contextmanager
def former(change: str):
    """The code ``change`` replaced, for the duration of the block."""
    import torch

    from areal_mega.engine import finite
    from areal_mega.models import varlen_attention

    if change == "finite":
        saved = finite.all_finite
        finite.all_finite = lambda t: bool(torch.isfinite(t).all())
        try:
            yield
        finally:
            finite.all_finite = saved
    elif change == "attention_fp32":
        saved = varlen_attention.CPU_FP32_ATTENTION_MAX_QUERY
        varlen_attention.CPU_FP32_ATTENTION_MAX_QUERY = -1
        try:
            yield
        finally:
            varlen_attention.CPU_FP32_ATTENTION_MAX_QUERY = saved
    elif change == "unit_families":
        saved = varlen_attention.batch_entries
        varlen_attention.batch_entries = lambda units: [[u] for u in units]
        try:
            yield
        finally:
            varlen_attention.batch_entries = saved
    elif change == "grad_in_logits":
        import areal_mega.ops as ops

        saved = ops.logits_read_by_loss_only
        ops.logits_read_by_loss_only = lambda logits: False
        try:
            yield
        finally:
            ops.logits_read_by_loss_only = saved
    elif change == "width_batches":
        saved = varlen_attention.batch_entries, varlen_attention.split_batches
        former_pair = _former_entries_and_batches(varlen_attention)
        varlen_attention.batch_entries, varlen_attention.split_batches = former_pair
        try:
            yield
        finally:
            varlen_attention.batch_entries, varlen_attention.split_batches = saved
    elif change == "wgrad_fp32":
        from areal_mega.compat import main_grad

        saved = main_grad._FUSED
        main_grad.fused_bf16_available()  # resolve it first, then set it aside
        main_grad._FUSED = False
        try:
            yield
        finally:
            main_grad._FUSED = saved
    elif change == "reused_output":
        from areal_mega.compat import cpu_gemm

        saved = cpu_gemm.REUSE_MIN_BYTES
        cpu_gemm.REUSE_MIN_BYTES = 1 << 62
        try:
            yield
        finally:
            cpu_gemm.REUSE_MIN_BYTES = saved
    elif change == "bf16_widened":
        from areal_mega.common import cpu_bf16

        saved = os.environ.get(cpu_bf16.BF16_GEMM_ENV)
        os.environ[cpu_bf16.BF16_GEMM_ENV] = "native"
        try:
            yield
        finally:
            if saved is None:
                del os.environ[cpu_bf16.BF16_GEMM_ENV]
            else:
                os.environ[cpu_bf16.BF16_GEMM_ENV] = saved
    elif change == "all":
        with contextlib.ExitStack() as stack:
            for c in CHANGES:
                stack.enter_context(former(c))
            yield
    else:
        raise ValueError(f"unknown change {change!r}")


def child(args, hf_dir, dtype, out) -> None:
    """Build the actor at ``dtype``, one warm-up step per variant, then ``--pairs`` pairs per
    change; write the per-pair seconds to ``out``."""
    import argparse as ap_mod

    import torch

    from areal_mega.checkpoint.convert import _single_process_mesh
    from areal_mega.common.malloc import set_training_policy
    from areal_mega.config import load_config
    from areal_mega.engine import MegatronEngine
    from bench.engine import load_hf_weights
    from bench.grpo_step import grpo_step, make_trajectories

    set_training_policy()  # the trainer's malloc policy on CPU
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench_ab_run_") as run_dir:
        cfg = load_config(
            ROOT / "recipes" / "tiny-cpu.yaml",
            [
                f"model.path={hf_dir}",
                f"model.dtype={dtype}",
                f"logging.run_dir={run_dir}",
                f"rollout.batch_size={args.prompts}",
                f"rollout.n_samples={args.group}",
                f"rollout.max_new_tokens={args.max_new}",
            ]
            + ([f"scheduler.max_tokens_per_mb={args.mb_tokens}"] if args.mb_tokens else []),
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
    actor.optimizer.reload_model_params()
    targs = ap_mod.Namespace(
        prompts=args.prompts, group=args.group, max_new=args.max_new, prompt_len=args.prompt_len
    )
    vocab = SHAPE["vocab_size"]
    version = 0

    def step(seed):
        nonlocal version
        version += 1
        return grpo_step(actor, mesh, cfg, make_trajectories(targs, vocab, seed, version), version)

    changes = list(CHANGES) + ["all"] if args.change == "each" else [args.change]
    results = {}
    for change in changes:
        with former(change):
            step(0)  # warm-up of the former code's shapes
        step(0)
        rows = []
        for i in range(args.pairs):
            seed = 1000 * (changes.index(change) + 1) + i
            timed = {}
            order = ("new", "old") if i % 2 else ("old", "new")
            for which in order:
                with former(change) if which == "old" else contextlib.nullcontext():
                    timed[which] = step(seed)
            rows.append({w: [timed[w]["total_s"], timed[w]["cpu_s"]] for w in timed})
        results[change] = rows
    mesh.destroy(process_group=True)
    Path(out).write_text(json.dumps(results))


def report(dtype, results) -> None:
    print(f"\n{dtype}: median over pairs (A: former code, B: as it is; A/B > 1: B is faster)")
    print(
        f"  {'change':16s}{'pairs':>6s}{'A wall s':>10s}{'B wall s':>10s}{'A/B wall':>10s}"
        f"{'A CPU s':>9s}{'B CPU s':>9s}{'A/B CPU':>9s}"
    )
    for change, rows in results.items():
        med = lambda f, rows=rows: statistics.median(f(r) for r in rows)  # noqa: E731
        print(
            f"  {change:16s}{len(rows):6d}{med(lambda r: r['old'][0]):10.3f}"
            f"{med(lambda r: r['new'][0]):10.3f}{med(lambda r: r['old'][0] / r['new'][0]):9.2f}x"
            f"{med(lambda r: r['old'][1]):9.2f}{med(lambda r: r['new'][1]):9.2f}"
            f"{med(lambda r: r['old'][1] / r['new'][1]):8.2f}x"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    ap.add_argument("--change", choices=CHANGES + ("all", "each"), default="each")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4, help="layers of the 135M-shape model")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument("--max-new", type=int, default=60)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--mb-tokens", type=int, default=0, help="scheduler.max_tokens_per_mb (0: the recipe's)"
    )
    ap.add_argument("--child", nargs=3, metavar=("HF_DIR", "DTYPE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args, *args.child)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.cpu_bf16 import cpu_description

    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_description()}; {args.threads} threads")
    print(f"load average (1, 5, 15 min): {os.getloadavg()} on {os.cpu_count()} CPUs")
    print(
        f"135M shape, {args.layers} layers; {args.prompts} prompts x {args.group} samples, "
        f"prompt {args.prompt_len} tokens, completion 1-{args.max_new}"
    )
    with tempfile.TemporaryDirectory(prefix="bench_ab_") as tmp:
        hf = Path(tmp) / "135M"
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**dict(SHAPE, num_hidden_layers=args.layers))).save_pretrained(
            hf
        )
        for dtype in ("fp32", "bf16") if args.dtype == "both" else (args.dtype,):
            out = Path(tmp) / f"{dtype}.json"
            cmd = [sys.executable, __file__, "--child", str(hf), dtype, str(out)] + [
                f"--{k.replace('_', '-')}={v}"
                for k, v in vars(args).items()
                if k not in ("child", "dtype")
            ]
            env = dict(os.environ, PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode or not out.exists():
                sys.exit(f"{dtype} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            report(dtype, json.loads(out.read_text()))


if __name__ == "__main__":
    sys.exit(main())
