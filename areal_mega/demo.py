"""The CPU demo: a tiny model learns to reverse digit strings with asynchronous GRPO.

    make demo                      # or: python -m areal_mega.demo [--rl-steps 300] [--eta 1]
    make demo-vlm                  # or: python -m areal_mega.demo task=vlm

``task=vlm`` (or ``--task vlm``) runs the same steps on a vision-language task: a tiny
Qwen2.5-VL (a two-block vision tower, printable-ASCII vocabulary) counts the shapes of a
synthetic 56x56 picture (:mod:`areal_mega.data.synthetic_vision`, ``How many shapes?`` ->
``3``); the SFT warm-up and GRPO train on the images (``recipes/tiny-vl-cpu.yaml``).
The steps (``task=reverse``, the default):

1. builds a tiny Llama-like HF model (hidden 128, 2 layers, digits vocabulary) and the
   synthetic task (``48312=`` -> ``21384<eos>``, reward 1 for an exact match);
2. warms it up with a short SFT on the Megatron engine (deliberately short: RL needs room);
3. runs asynchronous GRPO with ``launch.local``: a CPU rollout server, the rollout worker,
   the ZMQ data plane and the trainer (staleness bound ``rollout.max_head_offpolicyness``);
4. prints the reward gain, the first PPO step's ``ppo_kl`` and the mismatch, the time split
   per step, held-out greedy accuracy before and after RL, and where the run directory,
   metrics and plots are.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from areal_mega.common.net import free_port
from areal_mega.config import ConfigError, check_against_model, load_config
from areal_mega.data.images import prompt_images
from areal_mega.data.synthetic import write_task_files
from areal_mega.data.synthetic_vision import write_task as write_vision_task
from areal_mega.models.tiny import make_tiny_model

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
RECIPE = RECIPES / "tiny-cpu.yaml"
MODEL = dict(
    arch="llama",
    charset="digits",
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    intermediate_size=256,
    tie_word_embeddings=True,
)
#: the vision-language task's tiny Qwen2.5-VL (printable ASCII: the question's letters)
VL_MODEL = dict(
    arch="qwen2_5_vl",
    charset="ascii",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    tie_word_embeddings=True,
)


def write_reverse_data(out: Path, seed: int) -> None:
    """The text task's files: reverse 5-digit strings."""
    write_task_files(out, task="reverse", seed=seed)


def write_count_data(out: Path, seed: int) -> None:
    """The vision-language task's files: count 1..4 shapes in a 56x56 picture."""
    write_vision_task(out, "count", n_train=2048, n_test=256, seed=seed)


@dataclass(frozen=True)
class DemoTask:
    """What differs between the demo's tasks: the recipe, the tiny model, the data, how the
    held-out accuracy is measured, and the defaults of the command line."""

    recipe: Path
    model: dict
    write_data: Callable[[Path, int], None]
    accuracy: Callable[[Path, Path], float]
    sft_steps: int
    rl_steps: int
    sft_lr: float = 1e-3
    rl_overrides: tuple = field(default_factory=tuple)


def _run(
    cmd: list, log: Path, env: dict, *, metrics: Path = None, total: int = 0, desc: str = ""
) -> None:
    """Run ``cmd`` with its output in ``log``; follow ``metrics`` (the child's metrics.jsonl)
    with a progress bar showing the step, the reward and the time per step."""
    from tqdm import tqdm

    print(f"[demo] $ {' '.join(map(str, cmd))}\n[demo]   log: {log}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env)
        bar = tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True) if metrics else None
        seen = 0
        while proc.poll() is None:
            time.sleep(1.0)
            if bar is None or not metrics.exists():
                continue
            rows = [
                json.loads(x)
                for x in metrics.read_text().splitlines()[seen:]
                if x.strip().endswith("}")
            ]
            if rows:
                seen += len(rows)
                last = rows[-1]
                shown = {
                    k: f"{last[k]:.3f}"
                    for k in ("reward/mean", "loss", "nll")
                    if isinstance(last.get(k), float)
                }
                shown["s/step"] = f"{last.get('time/step', 0):.2f}"
                bar.set_postfix(shown, refresh=False)
                bar.update(last["step"] - bar.n)
        if bar is not None:
            bar.close()
        rc = proc.returncode
    if rc != 0:
        tail = log.read_text().splitlines()[-30:]
        raise SystemExit(
            f"[demo] step failed (exit {rc}); last lines of {log}:\n" + "\n".join(tail)
        )


def greedy_accuracy(model_dir: Path, test_file: Path, n: int = 256) -> float:
    """Exact-match accuracy of greedy decoding on held-out prompts (transformers, CPU). A
    LoRA run's published adapter (a PEFT directory) runs on its base model with ``peft``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = (model_dir / "adapter_config.json").is_file()
    base = (
        json.loads((model_dir / "adapter_config.json").read_text())["base_model_name_or_path"]
        if adapter
        else model_dir
    )
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, model_dir).eval()
    rows = [json.loads(line) for line in test_file.read_text().splitlines()[:n]]
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    width = max(len(p) for p in prompts)
    assert all(len(p) == width for p in prompts), "the demo task has fixed-width prompts"
    ids = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=len(rows[0]["answer"]) + 1,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    correct = 0
    for r, row in zip(out[:, width:].tolist(), rows):
        want = tok(row["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        correct += r[: len(want)] == want
    return correct / len(rows)


def vl_greedy_tokens(
    model_dir: Path, test_file: Path, max_new_tokens: int, n: int = 256, batch_size: int = 64
) -> list:
    """Greedy continuations (token ids) of the first ``n`` held-out image prompts with
    transformers' Qwen2.5-VL (CPU): each record's images decoded (:mod:`areal_mega.data.
    images`), its prompt rendered with the chat template and expanded by the image processor
    (:func:`~areal_mega.models.vlm.inputs.encode_sample`), as the trainer and the workflow do;
    prompts of one width, ``batch_size`` at a time."""
    import torch
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor

    tok = AutoTokenizer.from_pretrained(model_dir)
    proc = load_image_processor(model_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    rows = [json.loads(line) for line in test_file.read_text().splitlines()[:n]]
    samples = []
    for i, r in enumerate(rows):
        messages, images = prompt_images(
            r["prompt"], base_dir=test_file.parent, where=f"{test_file}: record {i}"
        )
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        samples.append(encode_sample(text, images, tok, proc))
    width = len(samples[0].input_ids)
    assert all(len(x.input_ids) == width for x in samples), "the demo task has fixed-width prompts"
    out = []
    for lo in range(0, len(samples), batch_size):
        chunk = samples[lo : lo + batch_size]
        with torch.no_grad():
            ids = model.generate(
                input_ids=torch.stack([x.input_ids for x in chunk]),
                attention_mask=torch.ones(len(chunk), width, dtype=torch.long),
                mm_token_type_ids=torch.stack([x.mm_token_type_ids for x in chunk]),
                pixel_values=torch.cat([x.pixel_values for x in chunk]),
                image_grid_thw=torch.cat([x.image_grid_thw for x in chunk]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        out += ids[:, width:].tolist()
    return out


def vl_greedy_accuracy(model_dir: Path, test_file: Path, n: int = 256) -> float:
    """Exact-match accuracy of greedy decoding on held-out image prompts
    (:func:`vl_greedy_tokens`); the answer must be followed by EOS."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in test_file.read_text().splitlines()[:n]]
    wants = [
        tok(str(r["answer"]), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        for r in rows
    ]
    got = vl_greedy_tokens(model_dir, test_file, max(len(w) for w in wants), n=n)
    return sum(g[: len(w)] == w for g, w in zip(got, wants)) / len(rows)


def summarize(metrics_file: Path) -> dict:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] >= 1]  # step 0: the evaluation before training
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    k = min(10, len(rewards))

    def values(key, rs=rows):
        """The step values of ``key``; a step where it was undefined has no value (the
        trainer leaves an undefined mean out of the row)."""
        return [r[key] for r in rs if isinstance(r.get(key), (int, float)) and r[key] == r[key]]

    def mean(key, rs=rows):
        vals = values(key, rs)
        return sum(vals) / len(vals) if vals else float("nan")

    ev = [r["critic/explained_variance"] for r in rows if "critic/explained_variance" in r]
    critic = (
        {
            "explained_variance_first10": sum(ev[:k]) / k,
            "explained_variance_last10": sum(ev[-k:]) / k,
        }
        if len(ev) >= k > 0
        else {}
    )
    return {
        **critic,
        "steps": len(rows),
        "reward_first10": sum(rewards[:k]) / max(k, 1),
        "reward_last10": sum(rewards[-k:]) / max(k, 1),
        "ppo_kl_first_minibatch_step1": rows[0].get("ppo_kl/first_minibatch"),
        **(
            {"mismatch_mean": mean("mismatch"), "mismatch_max": max(values("mismatch"))}
            if values("mismatch")
            else {}
        ),
        "mismatch_steps": len(values("mismatch")),
        "staleness_max": max(r.get("staleness/max", 0) for r in rows),
        "time_step": mean("time/step"),
        "time_wait_rollout": mean("time/wait_data"),
        "time_logprobs": mean("time/logprobs"),
        "time_train": mean("time/train"),
        "time_weight_sync": mean("time/weight_sync"),
    }


def mismatch_text(s: dict) -> str:
    """The summary's mismatch figures: steps without a token of the trainer's version have
    no mismatch (left out of their metrics rows), so none may have one."""
    if not s.get("mismatch_steps"):
        return "none measured (no step trained tokens of the trainer's own version)"
    return (
        f"mean {s['mismatch_mean']:.2e}, max {s['mismatch_max']:.2e} (over the "
        f"{s['mismatch_steps']} steps with tokens of the trainer's version)"
    )


def prepare(
    run: Path,
    seed: int,
    sft_steps: int,
    env: dict,
    check=None,
    model: dict = None,
    task: str = "reverse",
) -> tuple:
    """Tiny model + task files + SFT warm-up; returns (sft model dir, data overrides, sft s).
    ``check(base model dir)`` runs before the SFT (the RL config against the model);
    ``model``: the tiny model's spec (:func:`~areal_mega.models.tiny.make_tiny_model`;
    default: the task's); ``task``: a key of :data:`TASKS`."""
    t = TASKS[task]
    base = make_tiny_model(run / "base_model", seed=seed, **(t.model if model is None else model))
    if check is not None:
        check(base)
    t.write_data(run / "data", seed)
    data = [
        f"data.train_path={run / 'data' / 'train.jsonl'}",
        f"data.test_path={run / 'data' / 'test.jsonl'}",
    ]
    t0 = time.time()
    env_sft = dict(env, MASTER_PORT=str(free_port()))
    _run(
        [
            sys.executable,
            "-m",
            "areal_mega.trainer",
            "--config",
            t.recipe,
            "mode=sft",
            f"model.path={base}",
            f"logging.run_dir={run / 'sft'}",
            f"total_steps={sft_steps}",
            f"optimizer.lr={t.sft_lr}",
            "optimizer.warmup_steps=0",
            "recover=off",
            "logging.progress_bar=false",
            "checkpoint.save_every=0",
            f"seed={seed}",
            *data,
        ],
        run / "sft.log",
        env_sft,
        metrics=run / "sft" / "metrics.jsonl",
        total=sft_steps,
        desc="SFT",
    )
    return run / "sft" / "hf_model", data, time.time() - t0


def rl_overrides(
    run_dir: Path,
    model: Path,
    data: list,
    steps: int,
    eta: int,
    seed: int,
    extra=(),
    task: str = "reverse",
) -> list:
    """The overrides of the RL run (the task's, then the user's ``extra`` last, so they
    win)."""
    return [
        f"model.path={model}",
        f"logging.run_dir={run_dir}",
        f"total_steps={steps}",
        f"rollout.max_head_offpolicyness={eta}",
        f"seed={seed}",
        "logging.progress_bar=false",
        *data,
        *TASKS[task].rl_overrides,
        *extra,
    ]


def check_rl_config(model: Path, args) -> None:
    """Load the RL run's config exactly as :func:`run_rl` will pass it (every user override
    included) and check it against ``model`` (a directory with the demo model's config.json,
    or a path that does not exist yet: then only the config itself is checked); raises
    :class:`~areal_mega.config.ConfigError` naming the bad key."""

    task = getattr(args, "task", "reverse")
    data = ["data.train_path=train.jsonl", "data.test_path=test.jsonl"]
    check_against_model(
        load_config(
            TASKS[task].recipe,
            rl_overrides(
                Path("rl"),
                model,
                data,
                args.rl_steps,
                args.eta,
                args.seed,
                args.overrides,
                task=task,
            ),
        )
    )


def run_rl(
    run_dir: Path,
    model: Path,
    data: list,
    steps: int,
    eta: int,
    seed: int,
    env: dict,
    extra=(),
    task: str = "reverse",
) -> float:
    """Asynchronous GRPO through launch.local; returns the wall time in seconds."""
    t0 = time.time()
    _run(
        [
            sys.executable,
            "-m",
            "areal_mega.launch.local",
            "--config",
            TASKS[task].recipe,
            *rl_overrides(run_dir, model, data, steps, eta, seed, extra, task=task),
        ],
        run_dir.with_suffix(".log"),
        env,
        metrics=run_dir / "metrics.jsonl",
        total=steps,
        desc=f"GRPO eta={eta}",
    )
    return time.time() - t0


def cpu_env() -> dict:
    return dict(
        os.environ, CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1"
    )


TASKS = {
    "reverse": DemoTask(
        recipe=RECIPE,
        model=MODEL,
        write_data=write_reverse_data,
        accuracy=greedy_accuracy,
        sft_steps=120,
        rl_steps=300,
    ),
    "vlm": DemoTask(
        recipe=RECIPES / "tiny-vl-cpu.yaml",
        model=VL_MODEL,
        write_data=write_count_data,
        accuracy=vl_greedy_accuracy,
        sft_steps=40,
        rl_steps=150,
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; ``task=NAME`` among the overrides selects the task like ``--task``."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--task", choices=sorted(TASKS), default=None, help="default: reverse")
    p.add_argument("--run-dir", default=None, help="default: runs/demo-<time>")
    p.add_argument("--sft-steps", type=int, default=None, help="default: the task's")
    p.add_argument("--rl-steps", type=int, default=None, help="default: the task's")
    p.add_argument("--eta", type=int, default=1, help="max_head_offpolicyness")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "overrides",
        nargs="*",
        help="task=NAME, then extra RL overrides, e.g. optimizer.lr=3e-4",
    )
    args = p.parse_args(argv)
    named = [o.split("=", 1)[1] for o in args.overrides if o.startswith("task=")]
    args.overrides = [o for o in args.overrides if not o.startswith("task=")]
    if named:
        if len(set(named + [args.task or named[0]])) != 1:
            p.error(f"two tasks named: {sorted(set(named + [args.task]))}")
        if named[0] not in TASKS:
            p.error(f"task={named[0]!r}: must be one of {sorted(TASKS)}")
        args.task = named[0]
    args.task = args.task or "reverse"
    t = TASKS[args.task]
    args.sft_steps = t.sft_steps if args.sft_steps is None else args.sft_steps
    args.rl_steps = t.rl_steps if args.rl_steps is None else args.rl_steps
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    task = TASKS[args.task]

    def check(model: Path) -> None:
        try:
            check_rl_config(model, args)
        except ConfigError as e:
            raise SystemExit(f"[demo] config error: {e}") from None

    check(Path("model-not-built-yet"))  # every override, before any work
    t_start = time.time()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    default_dir = (
        f"runs/demo-{stamp}" if args.task == "reverse" else f"runs/demo-{args.task}-{stamp}"
    )
    run = Path(args.run_dir or default_dir).resolve()
    run.mkdir(parents=True, exist_ok=True)
    env = cpu_env()
    print(f"[demo] run directory: {run}", flush=True)
    sft_model, data, t_sft = prepare(
        run, args.seed, args.sft_steps, env, check=check, task=args.task
    )
    acc_before = task.accuracy(sft_model, run / "data" / "test.jsonl")
    print(f"[demo] SFT done in {t_sft:.0f}s; held-out greedy accuracy {acc_before:.3f}", flush=True)
    t_rl = run_rl(
        run / "rl",
        sft_model,
        data,
        args.rl_steps,
        args.eta,
        args.seed,
        env,
        args.overrides,
        task=args.task,
    )
    final = sorted((run / "rl" / "weights").glob("v*"))[-1]
    acc_after = task.accuracy(final, run / "data" / "test.jsonl")
    s = summarize(run / "rl" / "metrics.jsonl")
    s.update(
        acc_before=acc_before,
        acc_after=acc_after,
        sft_seconds=t_sft,
        rl_seconds=t_rl,
        total_seconds=time.time() - t_start,
    )
    (run / "summary.json").write_text(json.dumps(s, indent=2))
    gain = s["reward_last10"] - s["reward_first10"]
    mismatch = mismatch_text(s)
    critic_line = (
        f"[demo] critic explained variance: first 10 steps "
        f"{s['explained_variance_first10']:.3f} -> last 10 steps "
        f"{s['explained_variance_last10']:.3f}\n"
        if "explained_variance_first10" in s
        else ""
    )
    print(
        f"""
[demo] ===================== summary =====================
[demo] RL steps: {s["steps"]} in {t_rl:.0f}s (SFT {t_sft:.0f}s, total {s["total_seconds"]:.0f}s)
[demo] mean reward: first 10 steps {s["reward_first10"]:.3f} -> last 10 steps \
{s["reward_last10"]:.3f} (gain {gain:+.3f})
{critic_line}[demo] held-out greedy accuracy: {acc_before:.3f} (after SFT) -> \
{acc_after:.3f} (after RL)
[demo] ppo_kl of the first PPO minibatch: {s["ppo_kl_first_minibatch_step1"]}
[demo] training/inference mismatch |logp_trainer - logp_rollout|: {mismatch}
[demo] staleness max: {s["staleness_max"]:.0f} (eta = {args.eta})
[demo] time per step {s["time_step"]:.2f}s: waiting for rollouts {s["time_wait_rollout"]:.2f}s,
[demo]   logprob recompute {s["time_logprobs"]:.2f}s, training {s["time_train"]:.2f}s, \
weight update {s["time_weight_sync"]:.2f}s
[demo] run dir:  {run}
[demo] metrics:  {run / "rl" / "metrics.jsonl"}
[demo] plot:     {run / "rl" / "reward_curve.png"}
[demo] summary:  {run / "summary.json"}""",
        flush=True,
    )


if __name__ == "__main__":
    main()
