"""Held-out quality against time, for bench/vs_trl/run.py: the points of each side (seconds from
its launch, start-up included, evaluations and snapshot saving left out), the evaluations of
the weights after both runs (our evaluation CLI, :mod:`bench.vs_trl.evaluate`) and the time
each side takes to reach the other's final score."""

import json
import sys
from pathlib import Path

from bench.vs_trl.machine import _env, run_pinned


def ours_quality(metrics_rows: list, t0: float) -> tuple:
    """Our held-out evaluations (the rows with ``eval/pass@1``) as ``(points, eval seconds)``:
    one point per evaluation, ``step``, ``t`` (seconds from the launch at ``t0``, start-up
    included, without the evaluations: the row's time less every ``eval/seconds`` up to and
    including its own, since the trainer waits for each), ``pass@1`` and ``reward`` (the mean
    held-out reward)."""
    points, spent = [], 0.0
    for r in sorted(metrics_rows, key=lambda r: r.get("step", 0)):
        if "eval/pass@1" not in r:
            continue
        spent += r.get("eval/seconds", 0.0)
        points.append(
            {
                "step": r["step"],
                "t": r["time"] - t0 - spent,
                "pass@1": r["eval/pass@1"],
                "reward": r.get("eval/reward"),
            }
        )
    return points, spent


def trl_times(rows: list, begin: float, t0: float, steps: list) -> dict:
    """The times (seconds from TRL's launch at ``t0``, start-up included, snapshot saving left
    out) at which TRL's weights of each of ``steps`` existed: step 0 at ``on_train_begin``
    (``begin``), step N at its row's ``time`` less the ``paused_s`` saving before it."""
    at = {r["step"]: r["time"] - t0 - r.get("paused_s", 0.0) for r in rows}
    return {s: begin - t0 if s == 0 else at[s] for s in steps}


def time_to_reach(points: list, target: float, key: str = "pass@1") -> float:
    """The first ``t`` of ``points`` (``t`` and ``key``: pass@1 or reward, in time order) whose
    ``key`` reaches ``target``; None when none does."""
    return next((p["t"] for p in points if p[key] >= target), None)


def eval_steps(steps: int, every: int) -> list:
    """The steps our trainer evaluates after with ``eval.every_steps=every``
    (``train.evaluation.eval_due``): every multiple of ``every`` and the last; step 0 (before
    training) is the initial model."""
    return sorted({s for s in range(every, steps + 1, every)} | {steps})


def data_shape(model: Path, data: Path) -> dict:
    """What our trainer needs to know of a prompt directory for ``model``: ``chat`` (its
    prompts are messages: rendered with the tokenizer's chat template, on both sides) and
    ``max_prompt_len`` (the longest prompt of train.jsonl and test.jsonl in tokens, as our
    dataset tokenizes it: no prompt is dropped)."""
    from areal_mega.data.dataset import PromptDataset, load_tokenizer, read_jsonl

    first = next(iter(read_jsonl(data / "train.jsonl")))
    chat = isinstance(first.get("prompt"), list)
    tok = load_tokenizer(str(model))
    longest = max(
        len(it.input_ids)
        for name in ("train.jsonl", "test.jsonl")
        for it in PromptDataset(
            data / name, tok, apply_chat_template=chat, max_prompt_len=1 << 30
        ).items
    )
    return {"chat": chat, "max_prompt_len": longest}


def run_evaluations(a, res: dict, model: Path, data: Path, out: Path) -> None:
    """After both runs, greedy pass@1 and the mean reward on the held-out ``test.jsonl`` with
    our evaluation CLI (:mod:`bench.vs_trl.evaluate`: one CPU rollout server of ours loading
    each weight directory in turn; ``a.reward``, a sample correct at reward >= 1, at most
    ``a.eval_max_new`` new tokens, the chat template as in training), pinned to ``a.cpus``:
    the initial model (``res["before"]``), our last published weights (``res["ours"]["after"]``,
    beside the trainer's own last evaluation) and each TRL snapshot (its ``quality`` points,
    the last one TRL's ``after``). Results and the log in ``out``."""
    jobs = {"initial": model}
    if "ours" in res:
        jobs["ours-final"] = max((Path(res["ours"]["run_dir"]) / "weights").glob("v*"))
    trl = res.get("trl")
    todo = [q for q in (trl or {}).get("quality") or [] if "pass@1" not in q]
    jobs.update({f"trl-step{q['step']}": Path(q["model"]) for q in todo if q["step"]})
    out.mkdir(parents=True, exist_ok=True)
    print(f"[vs_trl] held-out evaluation of {', '.join(jobs)} (log {out}.log)", flush=True)
    cmd = [
        sys.executable,
        "-m",
        "bench.vs_trl.evaluate",
        "--out",
        out,
        "--threads",
        len(a.cpus),
        "--models",
        *(f"{k}={v}" for k, v in jobs.items()),
        "--",
        "--data",
        data / "test.jsonl",
        "--temperature",
        "0",
        "--max-new-tokens",
        a.eval_max_new,
        "--reward-fn",
        a.reward,
        "--chat-template",
        "on" if a.chat else "off",
        "--max-prompt-len",
        a.max_prompt_len,
    ]
    rc, wall, _ = run_pinned(cmd, _env(len(a.cpus)), out.with_suffix(".log"), a.cpus, a.timeout)
    if rc != 0:
        raise SystemExit(f"the held-out evaluation failed (exit {rc}); see {out}.log")
    score = {}
    for name in jobs:
        overall = json.loads((out / f"{name}.json").read_text())["summary"]["overall"]
        score[name] = {"pass@1": overall["pass@1"], "reward": overall["reward"]}
    res["before"] = score["initial"]
    res["eval_wall"] = wall
    if "ours" in res:
        res["ours"]["after"] = score["ours-final"]
    for q in todo:
        q.update(score["initial"] if q["step"] == 0 else score[f"trl-step{q['step']}"])
    if trl and trl.get("quality"):
        trl["after"] = {k: trl["quality"][-1][k] for k in ("pass@1", "reward")}


def quality_summary(res: dict) -> dict:
    """For pass@1 and the mean held-out reward: each side's final score and the time the
    other side takes to reach it (:func:`time_to_reach`; None: never within its run)."""
    o = res.get("ours", {}).get("quality") or []
    t = (res.get("trl") or {}).get("quality") or []
    if not o or not t or "pass@1" not in t[-1]:
        return {}
    out = {"ours_s_total": o[-1]["t"], "trl_s_total": t[-1]["t"]}
    for key, name in (("pass@1", ""), ("reward", "reward_")):
        out.update(
            {
                f"ours_{name}final": o[-1][key],
                f"trl_{name}final": t[-1][key],
                f"ours_s_to_trl_{name}final": time_to_reach(o, t[-1][key], key),
                f"trl_s_to_ours_{name}final": time_to_reach(t, o[-1][key], key),
            }
        )
    return out
