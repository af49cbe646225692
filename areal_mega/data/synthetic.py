"""Synthetic verifiable tasks for the CPU demo, written as JSONL train/test files.

Tasks (every prompt and answer fits the tiny model's ``digits`` character vocabulary):

- ``reverse``: reverse a digit string, ``48312=`` -> ``21384`` (the demo's default; the probe
  that chose the demo's settings is in ``docs/benchmarks.md``, "The CPU demo").
- ``add``: small addition, ``12+34=`` -> ``46``.
- ``arith``: ``+``, ``-`` or ``*`` of two small numbers (non-negative results).

The matching reward is :func:`areal_mega.rewards.exact_match_reward` (``rollout.reward_fn =
areal_mega.rewards:exact_match_reward``): 1.0 when the completion is exactly the answer
followed by EOS (or the end of the text), else 0.0.

    python -m areal_mega.data.synthetic --out data/reverse --task reverse --n-train 4096
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Optional

from areal_mega.common.files import atomic_write

TASKS = ("reverse", "add", "arith")


def make_example(task: str, rng: random.Random, *, digits: int = 5, max_operand: int = 99) -> dict:
    """One ``{"prompt", "answer", "task"}`` record."""
    if task == "reverse":
        s = "".join(rng.choice("0123456789") for _ in range(digits))
        return {"prompt": f"{s}=", "answer": s[::-1], "task": task}
    if task == "add":
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b), "task": task}
    if task == "arith":
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        op = rng.choice("+-*")
        if op == "-" and b > a:
            a, b = b, a
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return {"prompt": f"{a}{op}{b}=", "answer": str(value), "task": task}
    raise ValueError(f"task={task!r}: must be one of {TASKS}")


def make_examples(
    task: str, n: int, seed: int = 0, *, exclude: Optional[set] = None, unique: bool = True, **kw
) -> list[dict]:
    """``n`` records, deterministic for ``seed``; prompts in ``exclude`` are skipped."""
    rng = random.Random(f"{task}-{seed}")
    exclude = exclude or set()
    seen: set = set()
    out = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(
                f"task={task!r}: cannot draw {n} distinct prompts "
                f"({len(out)} found); widen digits/max_operand or set unique=False"
            )
        ex = make_example(task, rng, **kw)
        if ex["prompt"] in exclude or (unique and ex["prompt"] in seen):
            continue
        seen.add(ex["prompt"])
        out.append(ex)
    return out


def write_jsonl(path: str | Path, records: list[dict]) -> Path:
    """Write ``records`` to ``path`` as JSON lines, atomically (not durably: generated data is
    written again by rerunning the generator). Returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(p, "".join(json.dumps(r) + "\n" for r in records), durable=False)


def write_task_files(
    out_dir: str | Path,
    task: str = "reverse",
    n_train: int = 4096,
    n_test: int = 256,
    seed: int = 0,
    **kw,
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``test.jsonl`` (disjoint prompts) under ``out_dir``."""
    out = Path(out_dir)
    test = make_examples(task, n_test, seed=seed + 1_000_003, **kw)
    train = make_examples(task, n_train, seed=seed, exclude={r["prompt"] for r in test}, **kw)
    return write_jsonl(out / "train.jsonl", train), write_jsonl(out / "test.jsonl", test)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="directory for train.jsonl and test.jsonl")
    p.add_argument("--task", choices=TASKS, default="reverse")
    p.add_argument("--n-train", type=int, default=4096)
    p.add_argument("--n-test", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digits", type=int, default=5, help="reverse: string length")
    p.add_argument("--max-operand", type=int, default=99, help="add/arith: operand range")
    a = p.parse_args(argv)
    kw = {"digits": a.digits} if a.task == "reverse" else {"max_operand": a.max_operand}
    train, test = write_task_files(a.out, a.task, a.n_train, a.n_test, a.seed, **kw)
    print(f"wrote {train} ({a.n_train} rows) and {test} ({a.n_test} rows)")


if __name__ == "__main__":
    main()
