"""Samples that crash the trainer are quarantined, not replayed forever.

An error raised while the engine prepares or runs a micro-batch carries that micro-batch's
sample ids (:func:`areal_mega.engine.finite.blame`). The dying trainer records them
(:func:`record_crash`: ``<run_dir>/quarantine/crash.rank<r>.json``, with the error). The next
trainer (:meth:`Quarantine.load`, rank 0, before the journal replay) counts each crashed
micro-batch in ``quarantine/suspects.json``; a micro-batch the trainer died on twice (the
relaunch failed on it again) has its samples quarantined: the entry screen drops them
(``refused/quarantine``) and writes each, with the error, to ``<run_dir>/quarantine.jsonl``.
Everything else is trained as before; a quarantined sample is never trained.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Optional

from areal_mega.common.files import atomic_write

__all__ = ["CRASHES_TO_QUARANTINE", "Quarantine", "record_crash"]

log = logging.getLogger(__name__)

#: deaths on the same micro-batch before its samples are quarantined (the first may be chance)
CRASHES_TO_QUARANTINE = 2


def _dir(run_dir) -> Path:
    return Path(run_dir) / "quarantine"


def record_crash(run_dir, rank: int, error: BaseException) -> bool:
    """When ``error`` names the samples it was raised on (``error.sample_ids``), write them and
    the error to ``<run_dir>/quarantine/crash.rank<rank>.json`` (durable); returns whether it
    did. Called by a trainer rank on its way out."""
    ids = getattr(error, "sample_ids", None)
    if not ids:
        return False
    d = _dir(run_dir)
    d.mkdir(parents=True, exist_ok=True)
    text = f"{type(error).__name__}: {error}"[:2000]
    atomic_write(
        d / f"crash.rank{rank}.json",
        json.dumps({"sample_ids": sorted(ids), "error": text}),
        durable=True,
    )
    return True


class Quarantine:
    """Rank 0's record of crashed micro-batches and quarantined samples under ``run_dir``."""

    def __init__(self, run_dir):
        self.run_dir = Path(run_dir)
        self.dir = _dir(run_dir)
        self.suspects_path = self.dir / "suspects.json"
        self.file = self.run_dir / "quarantine.jsonl"
        state = {}
        if self.suspects_path.exists():
            try:
                state = json.loads(self.suspects_path.read_text())
            except (OSError, ValueError) as e:
                log.warning("%s unreadable (%s); starting a new record", self.suspects_path, e)
        self.crashes: dict = state.get("crashes", {})  # key -> {sample_ids, count, error}
        self.quarantined: dict = state.get("quarantined", {})  # sample id -> error
        self._written: set = set(state.get("written", []))

    def __contains__(self, sample_id) -> bool:
        return str(sample_id) in self.quarantined

    def load(self) -> int:
        """Count the crash records a dying trainer left (then remove them); quarantine the
        samples of a micro-batch that reached :data:`CRASHES_TO_QUARANTINE`. Returns how many
        samples are newly quarantined."""
        new = 0
        found = sorted(self.dir.glob("crash.rank*.json")) if self.dir.is_dir() else []
        if not found:
            return 0
        for f in found:
            try:
                rec = json.loads(f.read_text())
            except (OSError, ValueError):
                continue
            ids = [str(x) for x in rec.get("sample_ids", [])]
            key = "|".join(sorted(ids))
            entry = self.crashes.setdefault(key, {"sample_ids": ids, "count": 0})
            entry["count"] += 1
            entry["error"] = rec.get("error", "")
            if entry["count"] >= CRASHES_TO_QUARANTINE:
                for sid in ids:
                    if sid not in self.quarantined:
                        self.quarantined[sid] = entry["error"]
                        new += 1
                print(
                    f"[areal-mega] quarantined {len(ids)} samples: the trainer died on their "
                    f"micro-batch {entry['count']} times ({entry['error'][:300]}); they are "
                    f"not trained, see {self.file}",
                    flush=True,
                )
        self._save()
        for f in found:
            f.unlink(missing_ok=True)
        return new

    def reason(self, sample_id) -> Optional[str]:
        """The error a quarantined sample's micro-batch raised, or None."""
        return self.quarantined.get(str(sample_id))

    def write(self, traj) -> None:
        """Append ``traj`` (whole) and its error to ``quarantine.jsonl``, once per sample."""
        sid = str(traj.sample_id)
        if sid in self._written:
            return
        rec = {
            "sample_id": sid,
            "group_id": traj.group_id,
            "error": self.reason(sid),
            "trajectory": _jsonable(traj.to_dict()),
        }
        with open(self.file, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self._written.add(sid)
        self._save()

    def stats(self) -> dict:
        """``quarantine/samples``: samples quarantined in this run."""
        return {"quarantine/samples": float(len(self.quarantined))}

    def _save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        atomic_write(
            self.suspects_path,
            json.dumps(
                {
                    "crashes": self.crashes,
                    "quarantined": self.quarantined,
                    "written": sorted(self._written),
                }
            ),
            durable=True,
        )


def _jsonable(x):
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x
