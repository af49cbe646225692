"""GRPO on a CPU, ours against TRL: the same work, one run of each, printed side by side.

    make trl-env                        # once: TRL's own Python 3.11 venv (.venv-trl)
    python -m bench.vs_trl              # the 135M Llama shape: 10 steps of 8 prompts x 8
    python -m bench.vs_trl --layers 2 --steps 3 --prompts 2 --group 4 --max-new 8   # smoke
    python -m bench.vs_trl --shape tiny --layers 2 --lr 1e-3 --steps 20   # a learning curve
    python -m bench.vs_trl --sft-steps 30    # 135M: SFT'd before RL, so both sides learn
    python -m bench.vs_trl --sft-steps 30 --rl-seed 2 --out runs/X   # X's warm start, seed 2

Model: the shape of a 135M Llama (hidden 576, 30 layers, 9 heads, 3 KV heads, FFN 1536,
vocabulary 49,152, tied embeddings; ``SHAPE`` of bench/engine.py; ``--layers`` shrinks it;
``--shape tiny``: the demo's hidden 128 over the 22 characters, which learns the task) with
random weights, written once with ``save_pretrained`` (fp32 safetensors) beside a tokenizer
built here: single characters for the prompts (digits, ``=``) and digit strings of 2-5
characters for the rest of the 49,152 ids, so that every id decodes to text the reward can
score. Task: the synthetic ``reverse`` prompts (``48312=``) after a fixed ``--instruction``
of 54 characters (one token each; the part of a chat prompt every sample shares, as a system
turn: 60-token prompts, ~75 tokens a sample like the issue's chat run), every answer ``0000``,
reward ``areal_mega.rewards:char_match_reward`` (partial credit per matching character;
``--reward`` names another): the same Python function on both sides (TRL's via an adapter).
The random model's 16 tokens of 2-5 digits score ~0.007 and do not learn in 10 steps:
``--sft-steps N`` first trains it N steps with our SFT on the reverse task's own answers (five
digits and EOS), so both sides start RL from that model with a reward to climb.

Each step: ``--prompts`` prompts x ``--group`` samples of at most ``--max-new`` new tokens at
temperature 1, group-normalised advantages, no KL term, one optimizer step (AdamW, constant
``--lr``, gradient clip 1.0) on a token-mean clipped (0.2) policy loss.

* ours: ``python -m areal_mega.launch.local`` with recipes/tiny-cpu.yaml (a CPU rollout
  server, the rollout worker, the trainer; staleness bound ``--eta``, default 1: the server
  generates the next batch while the trainer trains; ``--eta 0`` alternates them, as TRL
  does), times from its metrics.jsonl;
* TRL: bench/vs_trl/trl_side.py in .venv-trl: ``GRPOTrainer`` (``model.generate`` for rollouts),
  one generation batch of prompts x group samples per optimizer step, gradient checkpointing
  off unless ``--trl-grad-ckpt``.

Both run one after the other, each pinned to the same ``--cpus`` (default: the first two this
process may use), never together; ours with the launcher's thread split (one for the rollout
server, the rest for the trainer; extra positional arguments are overrides of our side, e.g.
``cluster.cpu_threads_per_trainer_rank=2``), TRL with torch on all of them.

Printed per side: the median wall time per step after the first (warm-up) step, from the
steps' end times (so process start-up and model loading are left out), samples/s and tokens/s
(prompt + completion tokens) at that pace, the time split (ours: the trainer's metrics; TRL:
its profiled ``model.generate`` and the rest of its rollout vs the rest of the step), the peak
memory of all the side's processes (the sum of their proportional set sizes, sampled every
second) and of its training process, and the reward per step. Then the ratio TRL s/step / ours
s/step (> 1: ours faster) and whether the target "ours at least 2x TRL's steps per hour" is
met. Written beside: vs_trl.json (everything printed) and vs_trl.png (both reward curves, when
matplotlib is there); another ``--eta`` or ``--rl-seed`` names its files after them
(:func:`run_names`): runs of several seeds and etas share one ``--out`` and its warm start.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.vs_trl.assets import ROOT, build_tokenizer, make_assets, warm_start  # noqa: F401

TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
TARGET = 2.0  # ours at least 2x TRL's steps per hour


# ------------------------------------------------------------------------------------- pure
def median_after_warmup(values: list, warmup: int = 1) -> float:
    """The median of ``values`` without the first ``warmup`` (all of them when fewer remain)."""
    rest = values[warmup:] or values
    return statistics.median(rest) if rest else float("nan")


def step_walls(ends: list, first: float) -> list:
    """Wall seconds per step: ``first``, then the time between consecutive step ends."""
    return [first] + [b - a for a, b in zip(ends, ends[1:])] if ends else []


def speed_ratio(trl_s_per_step: float, ours_s_per_step: float) -> tuple:
    """``(TRL s/step / ours s/step, met)``: > 1 means ours is faster; met when >= TARGET."""
    ratio = trl_s_per_step / ours_s_per_step if ours_s_per_step > 0 else float("nan")
    return ratio, ratio >= TARGET


def ours_steps(metrics_rows: list) -> list:
    """Our metrics.jsonl rows as the bench's step rows (``step``, ``wall``, ``reward``,
    ``tokens``, ``split``, ``peak_rss_gib``); rows without ``time/step`` (evaluations) are
    left out."""
    rows = sorted(
        (r for r in metrics_rows if r.get("step", 0) >= 1 and "time/step" in r),
        key=lambda r: r["step"],
    )
    walls = step_walls([r["time"] for r in rows], rows[0]["time/step"]) if rows else []
    return [
        {
            "step": r["step"],
            "wall": w,
            "reward": r.get("reward/mean"),
            "tokens": r.get("n_tokens_total"),
            "peak_rss_gib": r.get("mem/trainer_peak_rss_gib"),
            "split": {
                k: r.get(f"time/{k}") for k in ("wait_data", "logprobs", "train", "weight_sync")
            },
        }
        for r, w in zip(rows, walls)
    ]


def trl_steps(rows: list) -> list:
    """bench/vs_trl/trl_side.py's steps.jsonl rows as the bench's step rows; tokens per step from
    TRL's cumulative ``num_tokens``; the split: ``generate`` (inside ``model.generate``),
    ``rollout_rest`` (the rest of TRL's ``_prepare_inputs``: decoding, rewards, advantages)
    and ``train`` (the rest of the step: forward, backward, optimizer)."""
    out, seen = [], 0.0
    for r in sorted(rows, key=lambda r: r["step"]):
        tokens = None if r.get("num_tokens") is None else r["num_tokens"] - seen
        seen = r.get("num_tokens") or seen
        out.append(
            {
                "step": r["step"],
                "wall": r["wall"],
                "reward": r.get("reward"),
                "tokens": tokens,
                "peak_rss_gib": r.get("peak_rss_gib"),
                "split": {
                    "generate": r["generate_s"],
                    "rollout_rest": r["rollout_s"] - r["generate_s"],
                    "train": r["wall"] - r["rollout_s"],
                },
            }
        )
    return out


def side_summary(steps: list, samples_per_step: int) -> dict:
    """Median s/step after the warm-up step, samples/s and tokens/s at that pace (tokens: the
    mean per step after the warm-up step), the median of each split part, peak RSS, rewards."""
    s = median_after_warmup([r["wall"] for r in steps])
    tokens = [r["tokens"] for r in steps[1:] or steps if r["tokens"] is not None]
    split = {
        k: median_after_warmup([r["split"][k] for r in steps if r["split"][k] is not None])
        for k in (steps[0]["split"] if steps else {})
    }
    peaks = [r["peak_rss_gib"] for r in steps if r.get("peak_rss_gib") is not None]
    return {
        "steps": len(steps),
        "s_per_step": s,
        "samples_per_s": samples_per_step / s,
        "tokens_per_step": sum(tokens) / len(tokens) if tokens else float("nan"),
        "tokens_per_s": (sum(tokens) / len(tokens)) / s if tokens else float("nan"),
        "split": split,
        "train_proc_peak_rss_gib": max(peaks) if peaks else float("nan"),
        "rewards": [r["reward"] for r in steps],
        "walls": [r["wall"] for r in steps],
    }


# ---------------------------------------------------------------------------------- machine
def cpu_info(cpus: list) -> dict:
    """CPU model name, the widest x86 vector ISA (avx512f / avx2 / neither) and the cores."""
    text = Path("/proc/cpuinfo").read_text()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
        "unknown",
    )
    flags = set(
        next(
            (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
        )
    )
    isa = (
        "avx512f"
        if "avx512f" in flags
        else "avx2 (no avx512f)"
        if "avx2" in flags
        else "neither avx2 nor avx512f"
    )
    return {"model": model, "isa": isa, "cpus": cpus}


def _tree_pss_bytes(root: int) -> int:
    """The summed proportional set size (RSS where PSS is unreadable) of ``root`` and every
    process below it."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            fields = dict(
                ln.split(":", 1)
                for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
            )
            total += int(fields.get("Pss", fields.get("Rss", "0 kB")).split()[0]) * 1024
        except (OSError, ValueError):
            continue
    return total


def run_pinned(cmd: list, env: dict, log: Path, cpus: list, timeout: float) -> tuple:
    """Run ``cmd`` pinned to ``cpus`` (output to ``log``); returns ``(exit code, wall s, peak
    summed PSS bytes of its process tree)``, sampled every 5 s (each /proc scan costs CPU)."""
    t0, peak = time.time(), 0
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        )
        while proc.poll() is None:
            peak = max(peak, _tree_pss_bytes(proc.pid))
            if time.time() - t0 > timeout:
                os.killpg(proc.pid, 9)
                proc.wait()
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
    return proc.returncode, time.time() - t0, peak


# ------------------------------------------------------------------------------------ sides
def _env(threads: int) -> dict:
    return dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONWARNINGS="ignore",
    )


def run_ours(a, model: Path, data: Path, out: Path) -> dict:
    """Our GRPO run through launch.local; returns its step rows, wall and peak memory."""
    n = len(a.cpus)
    given = dict(o.split("=", 1) for o in a.ours_overrides if "=" in o)  # the last one wins
    from areal_mega.launch.local import cpu_threads_per_trainer_rank

    server_t = int(given.get("cluster.cpu_threads_per_server", 1))
    trainer_t = cpu_threads_per_trainer_rank(
        n,
        n_servers=1,
        nproc=1,
        server_threads=server_t,
        configured=int(given.get("cluster.cpu_threads_per_trainer_rank", 0)),
    )
    cmd = [
        sys.executable,
        "-m",
        "areal_mega.launch.local",
        "--config",
        ROOT / "recipes" / "tiny-cpu.yaml",
        "model_hparams=null",
        f"model.path={model}",
        "model.dtype=fp32",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.test_path={data / 'test.jsonl'}",
        f"logging.run_dir={out}",
        f"data.max_prompt_len={a.instruction + 16}",
        f"total_steps={a.steps}",
        f"rollout.batch_size={a.prompts}",
        f"rollout.n_samples={a.group}",
        f"rollout.max_new_tokens={a.max_new}",
        f"optimizer.lr={a.lr}",
        "optimizer.warmup_steps=0",
        "optimizer.clip_grad=1.0",
        "actor.temperature=1.0",
        "rollout.temperature=1.0",
        "algorithm.kl_coef=0.0",
        f"rollout.max_head_offpolicyness={a.eta}",
        f"rollout.reward_fn={a.reward}",
        f"rollout.weight_update={a.weight_update}",
        f"seed={a.rl_seed}",
        "recover=off",
        "checkpoint.save_every=0",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        f"cluster.cpu_threads_per_server={server_t}",
        f"cluster.cpu_threads_per_trainer_rank={trainer_t}",
        *a.ours_overrides,
    ]
    rc, wall, peak = run_pinned(cmd, _env(n), out.with_suffix(".log"), a.cpus, a.timeout)
    metrics = out / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        raise SystemExit(
            f"ours failed (exit {rc}); see {out.with_suffix('.log')} and {out / 'logs'}"
        )
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    return {
        "steps": ours_steps(rows),
        "wall": wall,
        "peak_pss_gib": peak / 2**30,
        "settings": {
            "launcher": "areal_mega.launch.local",
            "recipe": "tiny-cpu.yaml",
            "eta": a.eta,
            "weight_update": a.weight_update,
            "server_threads": server_t,
            "trainer_threads": trainer_t,
            "rollout_backend": "local (our CPU server)",
            "overrides": cmd[4:],
        },
    }


SAME_WORK = (
    "layers",
    "steps",
    "prompts",
    "group",
    "max_new",
    "lr",
    "seed",
    "rl_seed",
    "reward",
    "instruction",
    "shape",
    "sft_steps",
    "sft_lr",
)
# the work of runs older than these keys
BEFORE_KEY = {"instruction": 0, "shape": "135m", "sft_steps": 0, "sft_lr": 3e-4}


def work_of(run: dict) -> dict:
    """``run``'s ``SAME_WORK`` values; a key older runs lack takes its value of then
    (``BEFORE_KEY``; the RL seed was ``seed``)."""
    then = dict(BEFORE_KEY, rl_seed=run.get("seed"))
    return {k: run.get(k, then.get(k)) for k in SAME_WORK}


def earlier_trl_side(path: Path, res: dict) -> dict:
    """TRL's side of an earlier vs_trl.json of the same CPU and ``SAME_WORK`` (else exit)."""
    try:
        prev = json.loads(path.read_text())
        old, new = work_of(prev["run"]), work_of(res["run"])
        differ = [k for k in SAME_WORK if old[k] != new[k]] + (
            ["cpu"] if prev["cpu"] != res["cpu"] else []
        )
        trl = prev["trl"]
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"--trl-from {path}: not a vs_trl.json with a TRL side ({e!r})") from e
    if differ:
        raise SystemExit(f"--trl-from {path}: another machine or work ({', '.join(differ)})")
    trl["settings"] = dict(trl["settings"], reused_from=str(path))
    return trl


def require_trl_env() -> None:
    """Stop, naming ``make trl-env``, when TRL's environment (.venv-trl) is not built."""
    if not TRL_PYTHON.exists():
        raise SystemExit(
            f"{TRL_PYTHON} is missing: TRL runs in its own environment; build it "
            "with `make trl-env` (Python 3.11, requirements-trl.txt)"
        )


def run_trl(a, model: Path, data: Path, out: Path) -> dict:
    """TRL's GRPO run (bench/vs_trl/trl_side.py in .venv-trl); returns its step rows, wall, peak
    memory and settings."""
    require_trl_env()
    cmd = [
        TRL_PYTHON,
        "-m",
        "bench.vs_trl.trl_side",
        "--model",
        model,
        "--train",
        data / "train.jsonl",
        "--out",
        out,
        "--steps",
        a.steps,
        "--prompts",
        a.prompts,
        "--group",
        a.group,
        "--max-new",
        a.max_new,
        "--lr",
        a.lr,
        "--seed",
        a.rl_seed,
        "--threads",
        len(a.cpus),
        "--micro-batch",
        a.trl_micro_batch,
        "--reward",
        a.reward,
    ] + (["--grad-ckpt"] if a.trl_grad_ckpt else [])
    out.mkdir(parents=True, exist_ok=True)
    rc, wall, peak = run_pinned(cmd, _env(len(a.cpus)), out.with_suffix(".log"), a.cpus, a.timeout)
    steps = out / "steps.jsonl"
    if rc != 0 or not steps.exists():
        raise SystemExit(f"TRL failed (exit {rc}); see {out.with_suffix('.log')}")
    rows = [json.loads(x) for x in steps.read_text().splitlines() if x.strip()]
    return {
        "steps": trl_steps(rows),
        "wall": wall,
        "peak_pss_gib": peak / 2**30,
        "settings": json.loads((out / "meta.json").read_text()),
    }


# ----------------------------------------------------------------------------------- report
def report(res: dict) -> str:
    """The side-by-side table of :func:`main`'s results."""
    o, t = res["ours"]["summary"], res["trl"]["summary"]
    w = 40

    def row(label, a, b, fmt="{:.2f}"):
        def f(v):
            return "-" if v is None or v != v else fmt.format(v)

        return f"{label:{w}s}{f(a):>14s}{f(b):>14s}"

    cpu, run = res["cpu"], res["run"]
    lines = [
        f"CPU: {cpu['model']}, {cpu['isa']}; both sides pinned to cores {cpu['cpus']}",
        f"model: {run.get('shape', '135m')} Llama shape, {run['layers']} layers, fp32, "
        + (
            f"{run['sft_steps']} steps of our SFT (lr {run['sft_lr']}) from random weights; "
            if run.get("sft_steps")
            else "random weights; "
        )
        + f"{run['prompts']} prompts (a {run.get('instruction', 0)}-token shared instruction"
        f" + 6) x {run['group']} samples/step, <= {run['max_new']} new "
        f"tokens, lr {run['lr']}, {run['steps']} steps (median over steps 2..)"
        + (f", RL seed {run['rl_seed']}" if "rl_seed" in run else ""),
        f"ours: launch.local, eta={res['ours']['settings']['eta']}, weight update "
        f"{res['ours']['settings']['weight_update']}, server "
        f"{res['ours']['settings']['server_threads']} thread(s), trainer "
        f"{res['ours']['settings']['trainer_threads']}",
        (
            "TRL side reused from " + res["trl"]["settings"]["reused_from"] + "; "
            if res["trl"]["settings"].get("reused_from")
            else ""
        )
        + f"TRL {res['trl']['settings']['trl']} (torch {res['trl']['settings']['torch']}, "
        f"transformers {res['trl']['settings']['transformers']}): GRPOConfig "
        + ", ".join(f"{k}={v}" for k, v in res["trl"]["settings"]["config"].items()),
        "",
        f"{'':{w}s}{'ours':>14s}{'TRL':>14s}",
        row("s/step (median after warm-up)", o["s_per_step"], t["s_per_step"]),
        row("samples/s", o["samples_per_s"], t["samples_per_s"]),
        row("tokens/s (prompt + completion)", o["tokens_per_s"], t["tokens_per_s"], "{:.1f}"),
        row("tokens per step", o["tokens_per_step"], t["tokens_per_step"], "{:.0f}"),
        row("warm-up step s", o["walls"][0], t["walls"][0]),
        row(
            "process wall s (start-up included)", res["ours"]["wall"], res["trl"]["wall"], "{:.1f}"
        ),
        row(
            "peak memory GiB, all processes (PSS)",
            res["ours"]["peak_pss_gib"],
            res["trl"]["peak_pss_gib"],
        ),
        row(
            "peak RSS GiB, training process",
            o["train_proc_peak_rss_gib"],
            t["train_proc_peak_rss_gib"],
        ),
    ]
    lines += ["time split, median s/step:"]
    lines += [row(f"  ours {k}", v, None) for k, v in o["split"].items()]
    lines += [row(f"  TRL {k}", None, v) for k, v in t["split"].items()]
    lines += [
        "reward per step:",
        "  ours " + " ".join(f"{r:.3f}" if r is not None else "-" for r in o["rewards"]),
        "  TRL  " + " ".join(f"{r:.3f}" if r is not None else "-" for r in t["rewards"]),
        "",
        f"TRL s/step / ours s/step = {res['ratio']:.2f}x (> 1: ours faster); target "
        f"ours >= {TARGET:.0f}x TRL's steps per hour: "
        f"{'MET' if res['target_met'] else 'NOT met'}",
    ]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> bool:
    """Both reward curves, per step and against wall time, to ``path``; False without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for side, label in (("ours", "ours"), ("trl", f"TRL {res['trl']['settings']['trl']}")):
        s = res[side]["summary"]
        steps = list(range(1, len(s["rewards"]) + 1))
        t = [sum(s["walls"][:i]) for i in steps]
        ax1.plot(steps, s["rewards"], marker="o", label=label)
        ax2.plot(t, s["rewards"], marker="o", label=label)
    ax1.set(xlabel="step", ylabel="mean reward", title="reward per step")
    ax2.set(xlabel="wall seconds from the first step's start", title="reward over time")
    ax1.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_names(a) -> dict:
    """This run's names in ``--out``: ``eta`` 1 and the RL seed ``--seed`` keep the plain
    ``ours``, ``trl``, ``vs_trl.*``; another adds ``-eta``/``-seed`` so that runs of several
    seeds and etas share one ``--out`` and its warm start."""
    eta = f"-eta{a.eta}" if a.eta != 1 else ""
    seed = f"-seed{a.rl_seed}" if a.rl_seed != a.seed else ""
    return {"ours": f"ours{eta}{seed}", "trl": f"trl{seed}", "result": f"vs_trl{eta}{seed}"}


def main(argv=None) -> None:
    """Build the assets, run ours then TRL, print and write the comparison."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shape", choices=("135m", "tiny"), default="135m")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new", type=int, default=16, help="max new tokens per sample")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument(
        "--instruction",
        type=int,
        default=54,
        help="characters (tokens) of the "
        "instruction every prompt starts with (0: the bare 6-token prompts)",
    )
    p.add_argument("--eta", type=int, default=1, help="ours: rollout.max_head_offpolicyness")
    p.add_argument(
        "--weight-update",
        default="disk",
        choices=["disk", "distributed"],
        help="ours: rollout.weight_update (disk: the tiny-cpu recipe's)",
    )
    p.add_argument("--seed", type=int, default=1, help="assets and the SFT warm start")
    p.add_argument(
        "--rl-seed",
        type=int,
        default=None,
        help="both sides' RL runs (default: --seed); bench/vs_trl/seeds.py pools several",
    )
    p.add_argument(
        "--sft-steps",
        type=int,
        default=0,
        help="warm start: steps of our SFT on "
        "the reverse task's answers before both sides' RL (0: the random weights)",
    )
    p.add_argument("--sft-lr", type=float, default=3e-4)
    p.add_argument("--reward", default="areal_mega.rewards:char_match_reward")
    p.add_argument(
        "--cpus",
        default=None,
        help="cores for each side, e.g. 0,1 (default: the first two this process may use)",
    )
    p.add_argument(
        "--trl-micro-batch",
        type=int,
        default=0,
        help="TRL's per_device_train_batch_size (0: a step's samples at once)",
    )
    p.add_argument("--trl-grad-ckpt", action="store_true", help="TRL: gradient checkpointing")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per side")
    p.add_argument("--out", default=None, help="default: runs/vs-trl-<time>")
    p.add_argument(
        "--trl-from",
        default=None,
        help="a previous run's vs_trl.json: take TRL's "
        "side from it instead of running TRL again (same machine and work)",
    )
    p.add_argument("ours_overrides", nargs="*", help="extra overrides for our side")
    a = p.parse_args(argv)
    a.rl_seed = a.seed if a.rl_seed is None else a.rl_seed
    a.cpus = [int(c) for c in a.cpus.split(",")] if a.cpus else sorted(os.sched_getaffinity(0))[:2]
    if not a.trl_from:
        require_trl_env()  # before any work
    out = Path(a.out or ROOT / "runs" / f"vs-trl-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"[vs_trl] run directory {out}", flush=True)
    model, data = make_assets(out, a.layers, a.seed, a.instruction, a.shape)
    if a.sft_steps:
        print(f"[vs_trl] SFT warm start: {a.sft_steps} steps (log {out / 'sft.log'})", flush=True)
        model = warm_start(
            out,
            model,
            data,
            a.sft_steps,
            _env(len(a.cpus)),
            a.seed,
            a.sft_lr,
            max_prompt_len=a.instruction + 16,
        )
    res = {
        "cpu": cpu_info(a.cpus),
        "run": {
            k: getattr(a, k)
            for k in (
                "layers",
                "steps",
                "prompts",
                "group",
                "max_new",
                "lr",
                "eta",
                "weight_update",
                "seed",
                "rl_seed",
                "reward",
                "instruction",
                "shape",
                "sft_steps",
                "sft_lr",
            )
        },
    }
    if a.trl_from:
        res["trl"] = earlier_trl_side(Path(a.trl_from), res)
    names = run_names(a)
    for side, fn in (("ours", run_ours), ("trl", run_trl)):
        if side in res:
            continue
        print(f"[vs_trl] {side}: running (log {out / names[side]}.log)", flush=True)
        res[side] = fn(a, model, data, out / names[side])
        res[side]["summary"] = side_summary(res[side]["steps"], a.prompts * a.group)
        print(f"[vs_trl] {side}: {res[side]['summary']['s_per_step']:.2f} s/step", flush=True)
    res["ratio"], res["target_met"] = speed_ratio(
        res["trl"]["summary"]["s_per_step"], res["ours"]["summary"]["s_per_step"]
    )
    text = report(res)
    print("\n" + text)
    result = out / names["result"]
    result.with_suffix(".json").write_text(json.dumps(res, indent=2, default=str))
    result.with_suffix(".txt").write_text(text + "\n")
    png = result.with_suffix(".png")
    print(
        f"\n[vs_trl] summary {result.with_suffix('.json')}"
        + (f", plot {png}" if plot(res, png) else " (no matplotlib: no plot)")
    )


if __name__ == "__main__":
    main()
