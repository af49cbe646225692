"""bench/vs_trl/run.py's report: the side-by-side table (speed, memory, time split, rewards,
held-out quality against time, FLOPs) and the plot."""

from pathlib import Path

from bench.vs_trl.flops import dtype_peak

TARGET = 3.0  # ours at least 3x TRL's steps per hour


NO_SIDE = {"summary": {}, "settings": {}, "wall": None, "peak_pss_gib": None}


def _fmt(v, fmt="{:.2f}") -> str:
    return "-" if v is None or v != v else fmt.format(v)


def report(res: dict) -> str:
    """The side-by-side table of :func:`main`'s results (TRL's column empty when only our side
    ran)."""
    ours, trl = res["ours"], res.get("trl") or NO_SIDE
    o, t = ours["summary"], trl["summary"]
    w = 40

    def row(label, a, b, fmt="{:.2f}"):
        return f"{label:{w}s}{_fmt(a, fmt):>14s}{_fmt(b, fmt):>14s}"

    cpu, run = res["cpu"], res["run"]
    if run.get("model"):
        model = (
            f"model: {run['model']} ({run.get('arch', '?')}, its own tokenizer"
            + (", chat template" if run.get("chat") else "")
            + f"), {run.get('dtype', 'fp32')}; prompts {run['data']}; "
        )
    else:
        model = (
            f"model: {run.get('shape', '135m')} Llama shape, {run['layers']} layers, "
            f"{run.get('dtype', 'fp32')}, "
        ) + (
            f"{run['sft_steps']} steps of our SFT (lr {run['sft_lr']}) from random weights; "
            if run.get("sft_steps")
            else "random weights; "
        )
    s_ = ours["settings"]
    lines = [
        f"CPU: {cpu['model']}, {cpu['isa']}, bf16: {cpu.get('bf16', 'not recorded')}; both "
        f"sides pinned to cores {cpu['cpus']}",
        model
        + f"{run['prompts']} prompts"
        + (
            ""
            if run.get("model")
            else f" (a {run.get('instruction', 0)}-token shared instruction + 6)"
        )
        + f" x {run['group']} samples/step, <= {run['max_new']} new "
        f"tokens, lr {run['lr']}, {run['steps']} steps (median over steps 2..)"
        + (f", RL seed {run['rl_seed']}" if "rl_seed" in run else "")
        + (f", reward {run['reward']}" if run.get("reward") else ""),
        f"ours: launch.local, eta={s_['eta']}, weight update {s_['weight_update']}, server "
        f"{s_['server_threads']} thread(s), trainer {s_['trainer_threads']}",
    ]
    if trl is NO_SIDE:
        lines.append("TRL: not run (--ours-only)")
    else:
        lines.append(
            (
                "TRL side reused from " + trl["settings"]["reused_from"] + "; "
                if trl["settings"].get("reused_from")
                else ""
            )
            + f"TRL {trl['settings']['trl']} (torch {trl['settings']['torch']}, "
            f"transformers {trl['settings']['transformers']}): GRPOConfig "
            + ", ".join(f"{k}={v}" for k, v in trl["settings"]["config"].items())
        )
    lines += [
        "",
        f"{'':{w}s}{'ours':>14s}{'TRL':>14s}",
        row("s/step (median after warm-up)", o["s_per_step"], t.get("s_per_step")),
        row("samples/s", o["samples_per_s"], t.get("samples_per_s")),
        row("tokens/s (prompt + completion)", o["tokens_per_s"], t.get("tokens_per_s"), "{:.1f}"),
        row("tokens per step", o["tokens_per_step"], t.get("tokens_per_step"), "{:.0f}"),
        row("warm-up step s", o["walls"][0], (t.get("walls") or [None])[0]),
        row("process wall s (start-up included)", ours["wall"], trl["wall"], "{:.1f}"),
        row("peak memory GiB, all processes (PSS)", ours["peak_pss_gib"], trl["peak_pss_gib"]),
        row(
            "peak RSS GiB, training process",
            o["train_proc_peak_rss_gib"],
            t.get("train_proc_peak_rss_gib"),
        ),
    ]
    lines += ["time split, median s/step:"]
    lines += [row(f"  ours {k}", v, None) for k, v in o["split"].items()]
    lines += [row(f"  TRL {k}", None, v) for k, v in t.get("split", {}).items()]
    lines += [
        "reward per step:",
        "  ours " + " ".join(_fmt(r, "{:.3f}") for r in o["rewards"]),
    ] + (["  TRL  " + " ".join(_fmt(r, "{:.3f}") for r in t["rewards"])] if t else [])
    lines += quality_lines(res, row) + flops_lines(res, row)
    if "ratio" in res:
        lines += [
            "",
            f"TRL s/step / ours s/step = {res['ratio']:.2f}x (> 1: ours faster); target "
            f"ours >= {TARGET:.0f}x TRL's steps per hour: "
            f"{'MET' if res['target_met'] else 'NOT met'}",
        ]
    return "\n".join(lines)


def quality_lines(res: dict, row) -> list:
    """The report's held-out part: before/after, the curves, the time to the other's score."""
    ours, trl = res["ours"], res.get("trl") or NO_SIDE
    if "before" not in res:
        return []
    both = res["before"] if trl is not NO_SIDE else {"pass@1": None, "reward": None}
    lines = [
        "",
        "held-out greedy pass@1 (python -m areal_mega.eval on the saved weights; reward >= 1):",
        row("  before (the initial model)", res["before"]["pass@1"], both["pass@1"], "{:.3f}"),
        row(
            "  after",
            ours.get("after", {}).get("pass@1"),
            trl.get("after", {}).get("pass@1"),
            "{:.3f}",
        ),
        row("  mean held-out reward before", res["before"]["reward"], both["reward"], "{:.3f}"),
        row(
            "  mean held-out reward after",
            ours.get("after", {}).get("reward"),
            trl.get("after", {}).get("reward"),
            "{:.3f}",
        ),
        "time to quality (s from launch, start-up included, evaluation and snapshot saving "
        "left out):",
    ]
    for name, side in (("ours", ours), ("TRL", trl)):
        pts = side.get("quality") or []
        if not pts:
            continue
        lines.append(
            f"  {name:5s}"
            + "  ".join(
                f"step {q['step']} @ {q['t']:.1f}s: {_fmt(q.get('pass@1'), '{:.3f}')}"
                f" (r {_fmt(q.get('reward'), '{:.3f}')})"
                for q in pts
            )
        )
    lines.append(
        f"  ours' in-training evaluations took {ours.get('eval_seconds', 0.0):.1f} s in all; "
        f"TRL's snapshot saving {trl.get('snapshot_seconds', 0.0) or 0.0:.1f} s"
    )
    q = res.get("quality") or {}
    if q:

        def at(v):
            return "never" if v is None else f"{v:.1f} s"

        lines += [
            f"  {what}: ours to TRL's final {q[f'trl_{k}final']:.3f}: "
            f"{at(q[f'ours_s_to_trl_{k}final'])} (of its {q['ours_s_total']:.1f} s); TRL to "
            f"ours' final {q[f'ours_{k}final']:.3f}: {at(q[f'trl_s_to_ours_{k}final'])} "
            f"(of its {q['trl_s_total']:.1f} s)"
            for k, what in (("", "pass@1"), ("reward_", "reward"))
        ]
    return lines


def peaks_text(peaks: dict) -> str:
    """:func:`bench.vs_trl.flops.matmul_peaks`' result in GFLOP/s, one part per thread count."""
    return "; ".join(
        f"{n} thread(s) fp32 {p['float32'] / 1e9:.1f}, bf16 {p['bfloat16'] / 1e9:.1f}"
        for n, p in sorted(peaks.items(), key=lambda kv: int(kv[0]))
    )


def flops_lines(res: dict, row) -> list:
    """The report's FLOPs part: the model FLOPs per step, the matmul peaks, the achieved
    FLOP/s and their fraction of the peak of the run's dtype on the part's threads."""
    fl = res.get("flops")
    if not fl:
        return []
    g = 1e9
    peaks = fl["peak"]
    lines = ["", "model FLOPs per step (GFLOP; mean after warm-up; bench/vs_trl/flops.py):"]
    for kind, label in (
        ("train", "  trainer forward + backward"),
        ("prox", "  proximal forward (0: not run)"),
        ("generate", "  generation (prefill + decode)"),
    ):
        lines.append(
            row(
                label,
                (fl["ours"]["per_step"].get(kind) or 0) / g if fl.get("ours") else None,
                (fl["trl"]["per_step"].get(kind) or 0) / g if fl.get("trl") else None,
                "{:.3f}",
            )
        )
    lines.append(
        "matmul peak (the best of 1024^2 and 2048^2 products, same cores, torch.matmul or "
        "oneDNN), GFLOP/s: " + peaks_text(peaks)
    )
    dtype = res["run"].get("dtype", "fp32")
    lines.append(f"achieved GFLOP/s (% of the {dtype} peak on its threads):")
    for name, label in (
        ("train", "  trainer fwd+bwd (+optimizer)"),
        ("prox", "  proximal forward"),
        ("generate", "  generation"),
    ):
        cells = []
        for side in ("ours", "trl"):
            v = ((fl.get(side) or {}).get("flop_s") or {}).get(name)
            threads = (fl.get(side) or {}).get("threads", {}).get(name)
            if v is None or threads is None:
                cells.append("-")
                continue
            peak = dtype_peak(peaks, threads, dtype)
            cells.append(f"{v / g:.1f} ({100 * v / peak:.0f}%)")
        lines.append(f"{label:40s}{cells[0]:>14s}{cells[1]:>14s}")
    return lines


def plot(res: dict, path: Path) -> bool:
    """Both reward curves (per step and against wall time) and the held-out pass@1 and mean
    reward against seconds from launch, to ``path``; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    (ax1, ax2), (ax3, ax4) = axes
    sides = [("ours", "ours")]
    if res.get("trl"):
        sides.append(("trl", f"TRL {res['trl']['settings'].get('trl', '')}"))
    for side, label in sides:
        s = res[side]["summary"]
        steps = list(range(1, len(s["rewards"]) + 1))
        t = [sum(s["walls"][:i]) for i in steps]
        ax1.plot(steps, s["rewards"], marker="o", label=label)
        ax2.plot(t, s["rewards"], marker="o", label=label)
        pts = [q for q in res[side].get("quality") or [] if q.get("pass@1") is not None]
        ax3.plot([q["t"] for q in pts], [q["pass@1"] for q in pts], marker="o", label=label)
        ax4.plot([q["t"] for q in pts], [q["reward"] for q in pts], marker="o", label=label)
    ax1.set(xlabel="step", ylabel="mean training reward", title="training reward per step")
    ax2.set(xlabel="wall seconds from the first step's start", title="training reward over time")
    ax3.set(
        xlabel="seconds from launch (start-up included, evaluation left out)",
        ylabel="held-out greedy pass@1",
        title="time to quality: pass@1",
    )
    ax4.set(
        xlabel="seconds from launch (start-up included, evaluation left out)",
        ylabel="mean held-out reward",
        title="time to quality: reward",
    )
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
