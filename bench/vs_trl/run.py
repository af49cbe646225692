"""GRPO on a CPU, ours against TRL: the same work, one run of each, printed side by side.

    make trl-env                        # once: TRL's own Python 3.11 venv (.venv-trl)
    python -m bench.vs_trl              # the 135M Llama shape: 10 steps of 8 prompts x 8
    python -m bench.vs_trl --layers 2 --steps 3 --prompts 2 --group 4 --max-new 8   # smoke
    python -m bench.vs_trl --shape tiny --layers 2 --lr 1e-3 --steps 20   # a learning curve
    python -m bench.vs_trl --sft-steps 30    # 135M: SFT'd before RL, so both sides learn
    python -m bench.vs_trl --sft-steps 30 --rl-seed 2 --out runs/X   # X's warm start, seed 2
    python -m bench.vs_trl --model HF_DIR --data DIR --reward pkg.mod:fn   # any checkpoint

``--model``: any HF causal-LM directory (weights, ``config.json``, its own tokenizer and chat
template) instead of the synthetic model below, with ``--data``: a directory of ``train.jsonl``
and the held-out ``test.jsonl`` in our trainer's format (``prompt``: text, or chat messages
that both sides render with the tokenizer's chat template; ``answer``), and the reward
``--reward`` names (``fn(prompt, completion, answer, finish_reason=...)``, the same function on
both sides: TRL's through an adapter that gives it the finish reason by our rollout's rule, so
a completion cut at the token limit counts alike). ``--ours-only`` leaves TRL out.

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

Held-out quality against time: greedy pass@1 (a sample is correct at reward >= 1) and the mean
reward on ``test.jsonl``, at most ``--eval-max-new`` new tokens, before training, every
``--eval-every`` steps and after the last. Ours: the trainer's own evaluation (``eval.*``: it
waits while the rollout worker runs the prompts on the rollout server at the weights just
published); TRL: its model saved after those steps (:mod:`.trl_side` ``--snapshots``). After
both runs our evaluation CLI (``python -m areal_mega.eval`` through :mod:`.evaluate`: one CPU
server of ours, the same scorer for every set of weights) scores the initial model, our last
published weights and every TRL snapshot. Each point's time counts from the side's launch,
start-up included, with the evaluations (ours: every ``eval/seconds`` so far) and the snapshot
saving (TRL) taken out; printed, plotted, and the time each side takes to reach the other's
final pass@1. Ours' curve comes from the trainer's hook (the points of a run, no checkpoint
to convert); the CLI's score of our last weights stands beside it as a check. One bias, in
ours' favour and at most the evaluation seconds printed: the rollout worker goes on
generating training samples while the trainer waits for an evaluation.

``--dtype bf16``: both sides compute in bf16 (ours ``model.dtype=bf16``: bf16 weights and
matmuls with fp32 main parameters, gradients, log-probabilities and loss, the server generating
in bf16; TRL ``bf16=True``, the Trainer's autocast over its fp32 model); the held-out scores
come from one fp32 server of ours for every set of weights, as for fp32 runs.

Where the time goes (bench/vs_trl/flops.py): this machine's matmul peak (fp32 and bf16, the
better of ``torch.matmul`` and oneDNN's product, on the same cores, with each part's thread
count), the model FLOPs per step (trainer forward + backward, the proximal forward where it
runs, generation; each group's prompt once, the LM head where it is read) from the model's
``config.json`` and the steps' token counts, and the achieved FLOP/s against the peak of the
run's dtype:
the trainer's ``time/train`` and ``time/logprobs`` (ours) and TRL's train part; generation from
our rollout server's own forward timers and token counters (``/get_server_info``, polled
during the run) and TRL's profiled ``model.generate``.

Printed per side: the median wall time per step after the first (warm-up) step, from the
steps' end times (so process start-up and model loading are left out), samples/s and tokens/s
(prompt + completion tokens) at that pace, the time split (ours: the trainer's metrics; TRL:
its profiled ``model.generate`` and the rest of its rollout vs the rest of the step), the peak
memory of all the side's processes (the sum of their proportional set sizes, sampled every
second) and of its training process, and the reward per step. Then the ratio TRL s/step / ours
s/step (> 1: ours faster) and whether the target "ours at least 3x TRL's steps per hour" is
met. Written beside: vs_trl.json (everything printed) and vs_trl.png (both reward curves and
the held-out pass@1 and reward against time, when matplotlib is there), and the evaluations'
results in vs_trl-eval/; another ``--eta`` or ``--rl-seed`` names its files after them
(:func:`run_names`): runs of several seeds and etas share one ``--out`` and its warm start.
bench/vs_trl/table.py prints several runs (dtypes, new tokens, etas) as one table.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.vs_trl.assets import ROOT, build_tokenizer, make_assets, warm_start  # noqa: F401
from bench.vs_trl.flops import achieved_flops, matmul_peaks, model_dims, server_counters
from bench.vs_trl.machine import _env, cpu_info, run_pinned
from bench.vs_trl.quality import (
    data_shape,
    eval_steps,
    ours_quality,
    quality_summary,
    run_evaluations,
    trl_times,
)
from bench.vs_trl.report import TARGET, plot, report

TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"


# ------------------------------------------------------------------------------------- pure
def median_after_warmup(values: list, warmup: int = 1) -> float:
    """The median of ``values`` without the first ``warmup`` (all of them when fewer remain)."""
    rest = values[warmup:] or values
    return statistics.median(rest) if rest else float("nan")


def step_walls(ends: list, first: float, pauses: list = None) -> list:
    """Wall seconds per step: ``first``, then the time between consecutive step ends, less
    the step's ``pauses`` (seconds before its end that are no step's; none by default)."""
    pauses = pauses or [0.0] * len(ends)
    return [first] + [b - a - p for a, b, p in zip(ends, ends[1:], pauses[1:])] if ends else []


def speed_ratio(trl_s_per_step: float, ours_s_per_step: float) -> tuple:
    """``(TRL s/step / ours s/step, met)``: > 1 means ours is faster; met when >= TARGET."""
    ratio = trl_s_per_step / ours_s_per_step if ours_s_per_step > 0 else float("nan")
    return ratio, ratio >= TARGET


def ours_steps(metrics_rows: list) -> list:
    """Our metrics.jsonl rows as the bench's step rows (``step``, ``wall``, ``reward``,
    ``tokens``, ``n_samples``, ``response_len``, ``prox_recomputed``, ``split``,
    ``peak_rss_gib``); rows without ``time/step`` (evaluations) are left out, and the
    evaluation logged with a step is left out of its wall."""
    rows = sorted(
        (r for r in metrics_rows if r.get("step", 0) >= 1 and "time/step" in r),
        key=lambda r: r["step"],
    )
    # a held-out evaluation after a step is logged in its row (the next step starts after
    # it): its seconds are no step's
    walls = (
        step_walls(
            [r["time"] for r in rows],
            rows[0]["time/step"],
            [r.get("eval/seconds", 0.0) for r in rows],
        )
        if rows
        else []
    )
    return [
        {
            "step": r["step"],
            "wall": w,
            "reward": r.get("reward/mean"),
            "tokens": r.get("n_tokens_total"),
            "n_samples": r.get("n_samples"),
            "response_len": r.get("response_len/mean"),
            "prox_recomputed": bool(r.get("prox/recomputed")),
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
                "response_len": r.get("completion_len"),
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
    """Median s/step after the warm-up step, samples/s and tokens/s at that pace (tokens and
    completion lengths: the mean per step after the warm-up step), the median of each split
    part, peak RSS, rewards."""
    s = median_after_warmup([r["wall"] for r in steps])
    tokens = [r["tokens"] for r in steps[1:] or steps if r["tokens"] is not None]
    split = {
        k: median_after_warmup([r["split"][k] for r in steps if r["split"][k] is not None])
        for k in (steps[0]["split"] if steps else {})
    }
    peaks = [r["peak_rss_gib"] for r in steps if r.get("peak_rss_gib") is not None]
    lens = [r["response_len"] for r in steps[1:] or steps if r.get("response_len") is not None]
    return {
        "steps": len(steps),
        "s_per_step": s,
        "samples_per_s": samples_per_step / s,
        "tokens_per_step": sum(tokens) / len(tokens) if tokens else float("nan"),
        "tokens_per_s": (sum(tokens) / len(tokens)) / s if tokens else float("nan"),
        "response_len": sum(lens) / len(lens) if lens else float("nan"),
        "split": split,
        "train_proc_peak_rss_gib": max(peaks) if peaks else float("nan"),
        "rewards": [r["reward"] for r in steps],
        "walls": [r["wall"] for r in steps],
    }


# ------------------------------------------------------------------------------------ sides
def thread_split(a) -> tuple:
    """Our side's ``(server threads, trainer threads)`` on ``a.cpus``: the launcher's split,
    or the ``cluster.*`` overrides given (the last one wins)."""
    from areal_mega.launch.local import cpu_threads_per_trainer_rank

    given = dict(o.split("=", 1) for o in a.ours_overrides if "=" in o)
    server_t = int(given.get("cluster.cpu_threads_per_server", 1))
    trainer_t = cpu_threads_per_trainer_rank(
        len(a.cpus),
        n_servers=1,
        nproc=1,
        server_threads=server_t,
        configured=int(given.get("cluster.cpu_threads_per_trainer_rank", 0)),
    )
    return server_t, trainer_t


def run_ours(a, model: Path, data: Path, out: Path) -> dict:
    """Our GRPO run through launch.local, evaluating the held-out prompts greedily before
    training, every ``a.eval_every`` steps and after the last (the trainer's ``eval.*``
    evaluation, on the rollout server); returns its step rows, evaluation points, wall, peak
    memory and the rollout server's counters."""
    server_t, trainer_t = thread_split(a)
    n = len(a.cpus)
    cmd = [
        sys.executable,
        "-m",
        "areal_mega.launch.local",
        "--config",
        ROOT / "recipes" / "tiny-cpu.yaml",
        "model_hparams=null",
        f"model.path={model}",
        f"model.dtype={a.dtype}",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.test_path={data / 'test.jsonl'}",
        f"data.apply_chat_template={str(a.chat).lower()}",
        f"logging.run_dir={out}",
        f"data.max_prompt_len={a.max_prompt_len}",
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
        f"eval.data=[{data / 'test.jsonl'}]",
        f"eval.every_steps={a.eval_every}",
        "eval.temperature=0.0",
        f"eval.max_new_tokens={a.eval_max_new}",
        f"seed={a.rl_seed}",
        "recover=off",
        "checkpoint.save_every=0",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        f"cluster.cpu_threads_per_server={server_t}",
        f"cluster.cpu_threads_per_trainer_rank={trainer_t}",
        f"scheduler.max_tokens_per_mb={a.mb_tokens}",
        *a.ours_overrides,
    ]
    t0 = time.time()
    with server_counters(out) as server:
        rc, wall, peak = run_pinned(cmd, _env(n), out.with_suffix(".log"), a.cpus, a.timeout)
    metrics = out / "metrics.jsonl"
    if rc != 0 or not metrics.exists():
        raise SystemExit(
            f"ours failed (exit {rc}); see {out.with_suffix('.log')} and {out / 'logs'}"
        )
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    points, eval_s = ours_quality(rows, t0)
    return {
        "steps": ours_steps(rows),
        "quality": points,
        "eval_seconds": eval_s,
        "run_dir": str(out),
        "server": dict(server),
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
    "model",
    "data",
    "dtype",
)
# the work of runs older than these keys
BEFORE_KEY = {
    "instruction": 0,
    "shape": "135m",
    "sft_steps": 0,
    "sft_lr": 3e-4,
    "model": None,
    "data": None,
    "dtype": "fp32",
}


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
        same_cpu = all(prev["cpu"].get(k) == res["cpu"].get(k) for k in ("model", "isa", "cpus"))
        differ = [k for k in SAME_WORK if old[k] != new[k]] + ([] if same_cpu else ["cpu"])
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
        "--dtype",
        a.dtype,
        "--snapshots",
        ",".join(str(x) for x in eval_steps(a.steps, a.eval_every)),
    ] + (["--grad-ckpt"] if a.trl_grad_ckpt else [])
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rc, wall, peak = run_pinned(cmd, _env(len(a.cpus)), out.with_suffix(".log"), a.cpus, a.timeout)
    steps = out / "steps.jsonl"
    if rc != 0 or not steps.exists():
        raise SystemExit(f"TRL failed (exit {rc}); see {out.with_suffix('.log')}")
    rows = [json.loads(x) for x in steps.read_text().splitlines() if x.strip()]
    timing = json.loads((out / "timing.json").read_text())
    times = trl_times(rows, timing["begin"], t0, [0] + eval_steps(a.steps, a.eval_every))
    return {
        "steps": trl_steps(rows),
        # the weights of each evaluated step, scored after both runs (run_evaluations)
        "quality": [
            {"step": k, "t": t, "model": str(model if k == 0 else out / "snapshots" / f"step{k}")}
            for k, t in sorted(times.items())
        ],
        "snapshot_seconds": timing["paused_s"],
        "wall": wall,
        "peak_pss_gib": peak / 2**30,
        "settings": json.loads((out / "meta.json").read_text()),
    }


def run_names(a) -> dict:
    """This run's names in ``--out``: fp32, 16 new tokens, ``eta`` 1 and the RL seed
    ``--seed`` keep the plain ``ours``, ``trl``, ``vs_trl.*``; another adds
    ``-bf16``/``-new``/``-eta``/``-seed`` so that a whole grid of dtypes, answer lengths,
    seeds and etas shares one ``--out`` and its warm start."""
    eta = f"-eta{a.eta}" if a.eta != 1 else ""
    seed = f"-seed{a.rl_seed}" if a.rl_seed != a.seed else ""
    dtype = f"-{a.dtype}" if a.dtype != "fp32" else ""
    new = f"-new{a.max_new}" if a.max_new != 16 else ""
    return {
        "ours": f"ours{dtype}{new}{eta}{seed}",
        "trl": f"trl{dtype}{new}{seed}",
        "result": f"vs_trl{dtype}{new}{eta}{seed}",
    }


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
        "--dtype",
        choices=("fp32", "bf16"),
        default="fp32",
        help="both sides' compute: ours model.dtype (bf16 weights and matmuls, fp32 main "
        "parameters, gradients and loss; the server generates in bf16), TRL bf16=True "
        "(autocast over its fp32 model)",
    )
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
    p.add_argument(
        "--reward",
        default="areal_mega.rewards:char_match_reward",
        help="module:function(prompt, completion, answer, finish_reason=...) -> float, for "
        "both sides (TRL's through an adapter) and the held-out evaluation",
    )
    p.add_argument(
        "--model",
        default=None,
        help="an HF causal-LM directory (weights, config, its tokenizer and chat template) "
        "for both sides, instead of the synthetic model (--shape/--layers/--instruction and "
        "--sft-steps then do not apply); needs --data",
    )
    p.add_argument(
        "--data",
        default=None,
        help="with --model: a directory of train.jsonl and the held-out test.jsonl in our "
        "trainer's format (prompt: text or chat messages, answer)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="held-out evaluations every N steps, besides before the first and after the last "
        "(0: a quarter of --steps)",
    )
    p.add_argument(
        "--eval-max-new",
        type=int,
        default=0,
        help="max new tokens of the held-out evaluation (0: --max-new)",
    )
    p.add_argument("--ours-only", action="store_true", help="run our side only (no TRL)")
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
    p.add_argument(
        "--mb-tokens",
        type=int,
        default=2048,
        help="ours: scheduler.max_tokens_per_mb, the tokens the model computes per micro-batch "
        "(each group's prompt once; the recipe's 512 splits an 8x8 step in two); 2048: a "
        "step in one micro-batch, as TRL's --trl-micro-batch 0 takes it",
    )
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
    if bool(a.model) != bool(a.data):
        p.error("--model and --data go together")
    if a.model and a.sft_steps:
        p.error("--sft-steps warms up the synthetic model only (not --model)")
    a.eval_every = a.eval_every or max(1, a.steps // 4)
    a.eval_max_new = a.eval_max_new or a.max_new
    a.rl_seed = a.seed if a.rl_seed is None else a.rl_seed
    a.cpus = [int(c) for c in a.cpus.split(",")] if a.cpus else sorted(os.sched_getaffinity(0))[:2]
    if not (a.trl_from or a.ours_only):
        require_trl_env()  # before any work
    out = Path(a.out or ROOT / "runs" / f"vs-trl-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    print(f"[vs_trl] run directory {out}", flush=True)
    if a.model:
        model, data = Path(a.model).resolve(), Path(a.data).resolve()
        a.chat, a.max_prompt_len = data_shape(model, data).values()
    else:
        model, data = make_assets(out, a.layers, a.seed, a.instruction, a.shape)
        a.chat, a.max_prompt_len = False, a.instruction + 16
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
                "model",
                "data",
                "dtype",
                "chat",
                "max_prompt_len",
                "eval_every",
                "eval_max_new",
                "mb_tokens",
            )
        },
    }
    config = json.loads((model / "config.json").read_text())
    res["run"]["arch"] = (config.get("architectures") or [config.get("model_type")])[0]
    if a.trl_from:
        res["trl"] = earlier_trl_side(Path(a.trl_from), res)
    names = run_names(a)
    res["flops"] = {"peak": matmul_peaks(a.cpus, [*thread_split(a), len(a.cpus)])}
    for side, fn in (("ours", run_ours), ("trl", run_trl)):
        if side in res or (side == "trl" and a.ours_only):
            continue
        print(f"[vs_trl] {side}: running (log {out / names[side]}.log)", flush=True)
        res[side] = fn(a, model, data, out / names[side])
        res[side]["summary"] = side_summary(res[side]["steps"], a.prompts * a.group)
        print(f"[vs_trl] {side}: {res[side]['summary']['s_per_step']:.2f} s/step", flush=True)
    if "trl" in res:
        res["ratio"], res["target_met"] = speed_ratio(
            res["trl"]["summary"]["s_per_step"], res["ours"]["summary"]["s_per_step"]
        )
    run_evaluations(a, res, model, data, out / f"{names['result']}-eval")
    res["quality"] = quality_summary(res)
    server_t, trainer_t = thread_split(a)
    threads = {"server": server_t, "trainer": trainer_t, "trl": len(a.cpus)}
    res["flops"].update(
        achieved_flops(res, model_dims(config), a.prompts * a.group, threads, a.group)
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
