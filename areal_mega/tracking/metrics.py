"""Training observability: ``metrics.jsonl``, tensorboard scalars, a progress bar, a plot.

    logger = MetricsLogger(run_dir, tensorboard=True, resume_step=None)
    logger.log(step, {"reward/mean": 0.4, "loss": 0.1, ...})   # one JSON line, fsync'd
    logger.close()
    plot_metrics(run_dir / "metrics.jsonl", run_dir / "reward.png")

Every step appends one JSON object (``{"step": ..., "time": ..., **scalars}``) to
``<run_dir>/metrics.jsonl`` and fsyncs it, so a crash loses at most the step being written.
On resume (``resume_step=k``) the file is rewritten atomically without records with
``step > k`` (the steps that will be redone), and a torn last line is dropped.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Iterable, Mapping, Optional

from areal_mega.common.files import atomic_write

METRICS_FILE = "metrics.jsonl"
# Keys the trainer is expected to log every step (issue 8); others are welcome.
STANDARD_KEYS = (
    "step",
    "version",
    "reward/mean",
    "loss",
    "ppo_kl",
    "mismatch",
    "staleness/max",
    "time/step",
    "tokens/s",
)


def _scalar(key: str, value) -> float | int | None:
    """A JSON-able number; tensors/numpy scalars are converted, non-numbers rejected."""
    if value is None or isinstance(value, bool):
        return None if value is None else int(value)
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, (int, float)):
        return value
    raise TypeError(f"metric {key!r}: expected a number, got {type(value).__name__}")


def read_metrics(path: str | Path) -> list[dict]:
    """All complete records of a ``metrics.jsonl`` (a torn or corrupt line is skipped)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    with p.open("r", encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # a torn final line from a crash mid-write
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "step" in rec:
                out.append(rec)
    return out


def truncate_metrics(path: str | Path, max_step: int) -> int:
    """Rewrite ``path`` atomically and durably (like the fsync'd appends) keeping records with
    ``step <= max_step``; returns how many records were removed (torn lines included)."""
    p = Path(path)
    if not p.exists():
        return 0
    total = sum(1 for _ in p.open("r", encoding="utf-8"))
    keep = [r for r in read_metrics(p) if r["step"] <= max_step]
    atomic_write(p, "".join(json.dumps(r) + "\n" for r in keep), durable=True)
    return total - len(keep)


class MetricsLogger:
    """Append-only per-step metrics: ``<run_dir>/metrics.jsonl`` plus tensorboard scalars.

    Args:
        run_dir: directory (created). ``tensorboard``: also write event files under
        ``<run_dir>/tensorboard``. ``resume_step``: drop records after this step (resume).
        ``enabled``: False on non-zero ranks makes every call a no-op.
    """

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        resume_step: Optional[int] = None,
        enabled: bool = True,
    ):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.enabled = enabled
        self._tb = None
        self._f = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_metrics(self.path, resume_step)
        elif self.path.exists():
            truncate_metrics(self.path, math.inf)  # only drops a torn final line
        self._f = self.path.open("a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step makes tensorboard hide events after the resumed step
            self._tb = SummaryWriter(
                str(self.run_dir / "tensorboard"),
                purge_step=None if resume_step is None else resume_step + 1,
            )

    def log(self, step: int, scalars: Mapping[str, object]) -> dict:
        """Write one record for ``step``; returns it. Durable when this returns."""
        if not self.enabled:
            return {}
        rec: dict = {"step": int(step), "time": round(time.time(), 3)}
        for k, v in scalars.items():
            if k in ("step", "time"):
                continue
            rec[k] = _scalar(k, v)
        line = json.dumps(rec, allow_nan=True)
        self._f.write(line + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())
        if self._tb is not None:
            for k, v in rec.items():
                if k not in ("step", "time") and v is not None:
                    self._tb.add_scalar(k, v, int(step))
            self._tb.flush()
        return rec

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ----------------------------------------------------------------------------- progress bar


class ProgressBar:
    """A tqdm bar over training steps showing reward, tokens/s and version.

    ``update(step, metrics)`` moves the bar to ``step`` (so a resumed run starts part-way).
    Disabled (no output) when ``enabled`` is False, e.g. on non-zero ranks.
    """

    def __init__(
        self,
        total_steps: int,
        initial_step: int = 0,
        enabled: bool = True,
        desc: str = "train",
        **tqdm_kw,
    ):
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=initial_step,
                desc=desc,
                unit="step",
                dynamic_ncols=True,
                **tqdm_kw,
            )
        self._step = initial_step

    @staticmethod
    def postfix(metrics: Mapping[str, object]) -> dict:
        """The short fields shown beside the bar."""
        out = {}
        for key, label, fmt in (
            ("reward/mean", "reward", "{:.3f}"),
            ("tokens/s", "tok/s", "{:.0f}"),
            ("version", "v", "{}"),
            ("loss", "loss", "{:.4f}"),
        ):
            v = metrics.get(key)
            if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v)):
                out[label] = fmt.format(v)
        return out

    def update(self, step: int, metrics: Mapping[str, object]) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix(self.postfix(metrics), refresh=False)
        self._bar.update(max(0, step - self._step))
        self._step = max(self._step, step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# ----------------------------------------------------------------------------- plotting


def moving_average(values: Iterable[float], window: int) -> list[float]:
    """Trailing mean over the last ``window`` values (shorter at the start)."""
    out, buf, total = [], [], 0.0
    for v in values:
        buf.append(v)
        total += v
        if len(buf) > window:
            total -= buf.pop(0)
        out.append(total / len(buf))
    return out


def source_reward_keys(records: Iterable[Mapping]) -> list[str]:
    """The per-source reward keys (``reward/<name>``, multi-task runs) found in ``records``."""
    keys = {k for r in records for k in r if k.startswith("reward/")}
    return sorted(keys - {"reward/mean", "reward/std"})


PANELS = (
    ("loss", "loss"),
    ("ppo_kl", "ppo_kl"),
    ("staleness/max", "staleness (max)"),
    ("time/step", "time / step (s)"),
    ("rollout/servers", "rollout servers"),
)


def eval_curve_keys(records: Iterable[Mapping]) -> list:
    """The evaluation curves drawn on the reward panel: ``eval/pass@1`` first, then each
    source's ``eval/<source>/pass@1``."""
    keys = {
        k
        for r in records
        for k in r
        if k.startswith("eval/") and k.endswith("/pass@1") or k == "eval/pass@1"
    }
    return sorted(keys, key=lambda k: (k != "eval/pass@1", k))


def plot_metrics(
    metrics_jsonl: str | Path, out_png: str | Path, window: int = 10, title: Optional[str] = None
) -> Path:
    """Draw the reward curve (raw + moving average; per-source moving averages for
    ``reward/<name>`` keys; the evaluation pass@1 curves of :func:`eval_curve_keys` when the
    run evaluated) and loss / ppo_kl / staleness /
    time-per-step / rollout-server-count panels into ``out_png``. Missing keys leave their
    panel empty."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_jsonl)
    if not recs:
        raise ValueError(f"{metrics_jsonl}: no metrics records to plot")

    def series(key):
        pts = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [float(p[1]) for p in pts]

    fig = plt.figure(figsize=(3 * len(PANELS), 7))
    grid = fig.add_gridspec(2, len(PANELS), height_ratios=[1.4, 1])
    ax = fig.add_subplot(grid[0, :])
    xs, ys = series("reward/mean")
    if xs:
        ax.plot(xs, ys, color="tab:blue", alpha=0.35, lw=1, label="reward/mean")
        ax.plot(
            xs,
            moving_average(ys, window),
            color="tab:blue",
            lw=2,
            label=f"moving average ({window})",
        )
        colors = (
            "tab:orange",
            "tab:green",
            "tab:red",
            "tab:purple",
            "tab:brown",
            "tab:pink",
            "tab:olive",
            "tab:cyan",
            "tab:gray",
        )
        for i, key in enumerate(source_reward_keys(recs)):  # multi-task: a curve per source
            sx, sy = series(key)
            ax.plot(
                sx,
                moving_average(sy, window),
                lw=1.5,
                ls="--",
                color=colors[i % len(colors)],
                label=f"{key} (moving average)",
            )
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no reward/mean", ha="center", va="center", transform=ax.transAxes)
    evals = eval_curve_keys(recs)
    colors = (
        "tab:orange",
        "tab:green",
        "tab:red",
        "tab:purple",
        "tab:brown",
        "tab:pink",
        "tab:olive",
        "tab:cyan",
        "tab:gray",
    )
    # a source's evaluation curve takes the colour of its training reward curve
    source_color = {
        k.split("/", 1)[1]: colors[i % len(colors)] for i, k in enumerate(source_reward_keys(recs))
    }
    for i, key in enumerate(evals):  # evaluation during training: pass@1 per eval step
        xs, ys = series(key)
        name = key[len("eval/") : -len("/pass@1")] if key != "eval/pass@1" else None
        color = (
            "black"
            if name is None
            else source_color.get(name, colors[(len(source_color) + i) % len(colors)])
        )
        ax.plot(
            xs,
            ys,
            marker="o",
            lw=2 if name is None else 1,
            ls="-" if name is None else ":",
            color=color,
            label=key,
        )
    if evals:
        ax.legend(loc="lower right")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    ax.set_title(title or f"{Path(metrics_jsonl).parent.name}: reward")
    for i, (key, label) in enumerate(PANELS):
        a = fig.add_subplot(grid[1, i])
        xs, ys = series(key)
        if xs:
            a.plot(xs, ys, lw=1)
        else:
            a.text(0.5, 0.5, "n/a", ha="center", va="center", transform=a.transAxes)
        a.set_title(label, fontsize=10)
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
