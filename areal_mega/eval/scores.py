"""Pure scoring of an evaluation: the unbiased pass@k estimator and the summary of per-prompt
records (no I/O, no torch).

A *record* is one prompt's outcome: ``{"source": str, "rewards": [float] * n,
"response_lens": [int] * n, "finish_reasons": [str] * n, ...}`` with ``n`` samples. A sample
is *correct* when its reward is at least ``pass_threshold`` (1.0 by default: full credit).
"""

from __future__ import annotations

from typing import Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``n`` samples of which ``c`` are correct (Chen et
    al. 2021): ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1..n} (1 - k/i)``,
    which needs no large binomials. Raises ``ValueError`` unless ``0 <= c <= n`` and
    ``1 <= k <= n``."""
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and n >= 1, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k={k} must be in [1, n={n}]")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_ks(n: int) -> list:
    """The k reported for ``n`` samples: 1, 2, 4, ... up to ``n``, and ``n`` itself."""
    if n < 1:
        raise ValueError(f"n_samples={n}: must be >= 1")
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def _summary(records: Sequence[dict], pass_threshold: float) -> dict:
    n = len(records[0]["rewards"])
    out: dict = {"n_prompts": len(records), "n_samples": n}
    correct = []
    for r in records:
        if len(r["rewards"]) != n:
            raise ValueError(
                f"record of source {r.get('source')!r}: {len(r['rewards'])} "
                f"samples, expected {n} like the others"
            )
        correct.append(sum(1 for x in r["rewards"] if x >= pass_threshold))
    for k in pass_ks(n):
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(records)
    samples = [
        (rew, ln, fin)
        for r in records
        for rew, ln, fin in zip(r["rewards"], r["response_lens"], r["finish_reasons"])
    ]
    out["reward"] = sum(s[0] for s in samples) / len(samples)
    out["response_len"] = sum(s[1] for s in samples) / len(samples)
    out["truncation_rate"] = sum(1 for s in samples if s[2] == "length") / len(samples)
    return out


def summarize(records: Iterable[dict], pass_threshold: float = 1.0) -> dict:
    """``{"overall": {...}, "per_source": {source: {...}}}``; each summary holds
    ``n_prompts``, ``n_samples``, ``pass@k`` for every k of :func:`pass_ks` (pass@1 is the
    fraction of correct samples, averaged over prompts), ``reward`` (mean over samples),
    ``response_len`` (mean generated tokens) and ``truncation_rate`` (fraction of samples that
    hit the token budget, ``finish_reason == "length"``). Raises ``ValueError`` on no records
    or records with different sample counts."""
    records = list(records)
    if not records:
        raise ValueError("summarize: no evaluation records (empty data?)")
    by_source: dict = {}
    for r in records:
        by_source.setdefault(str(r["source"]), []).append(r)
    return {
        "overall": _summary(records, pass_threshold),
        "per_source": {s: _summary(rs, pass_threshold) for s, rs in sorted(by_source.items())},
    }


def flat_metrics(summary: dict, prefix: str = "eval/") -> dict:
    """Scalars for ``metrics.jsonl``: ``eval/pass@1``, ... for the whole set and, when there is
    more than one source, ``eval/<source>/pass@1``, ... per source."""
    out = {f"{prefix}{k}": v for k, v in summary["overall"].items()}
    if len(summary["per_source"]) > 1:
        for src, s in summary["per_source"].items():
            out.update({f"{prefix}{src}/{k}": v for k, v in s.items()})
    return out


def format_table(summary: dict) -> str:
    """A plain-text table: one row for the whole set and one per source."""
    overall = summary["overall"]
    keys = [k for k in overall if k.startswith("pass@")] + [
        "reward",
        "response_len",
        "truncation_rate",
    ]
    rows = [("all", overall)] + list(summary["per_source"].items())
    width = max(12, *(len(name) for name, _ in rows))
    head = f"{'source':<{width}} {'prompts':>7} " + " ".join(f"{k:>15}" for k in keys)
    lines = [head, "-" * len(head)]
    for name, s in rows:
        lines.append(
            f"{name:<{width}} {s['n_prompts']:>7} " + " ".join(f"{s[k]:>15.4f}" for k in keys)
        )
    return "\n".join(lines)
