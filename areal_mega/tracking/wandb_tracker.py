"""Weights & Biases (``logging.trackers: [wandb]``; ``pip install -e .[wandb]``).

The run lives under ``<run_dir>/wandb/``; its id is kept in ``<run_dir>/wandb_run.json`` and a
resumed run calls ``wandb.init(id=..., resume="allow")``, so W&B continues the same run (offline,
each launch writes a segment with the same id, which ``wandb sync`` uploads as one run). Steps
the resumed trainer redoes are not logged again (:class:`~areal_mega.tracking.RunLog` passes only
steps above the last one logged). ``logging.wandb.mode=auto`` logs offline when there is no API
key (``WANDB_API_KEY``, ``~/.netrc``) or the server cannot be reached, and says so once; an
offline run is uploaded later with ``wandb sync <run_dir>/wandb/offline-run-*``.
"""

from __future__ import annotations

import logging
import netrc
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import wandb
from wandb.sdk.lib import runid

from areal_mega.common.errors import ConfigError
from areal_mega.tracking.base import TrackerState, finite_scalars
from areal_mega.tracking.samples import COLUMNS

log = logging.getLogger(__name__)


def _api_key_found(base_url: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(urlparse(base_url).hostname or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _reachable(base_url: str, timeout_s: float = 3.0) -> bool:
    u = urlparse(base_url)
    try:
        with socket.create_connection((u.hostname, u.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def resolve_mode(mode: str) -> tuple:
    """``(wandb mode, why offline or None)`` for ``logging.wandb.mode``; ``WANDB_MODE`` in the
    environment wins over ``auto``."""
    if mode != "auto":
        return mode, None
    env = os.environ.get("WANDB_MODE", "")
    if env:
        return env, None
    base_url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    if not _api_key_found(base_url):
        return "offline", "no W&B API key (WANDB_API_KEY or ~/.netrc)"
    if not _reachable(base_url):
        return "offline", f"{base_url} is not reachable"
    return "online", None


class WandbTracker:
    """One W&B run per areal-mega run (see the module doc)."""

    name = "wandb"

    def __init__(self, cfg, params: dict, run_dir: Path, resumed: bool):
        """Start or (``resumed``) continue the run; ``params``: the redacted config."""
        self.state = TrackerState(run_dir, self.name)
        if not resumed:
            self.state.data = {}
        w = cfg.logging.wandb
        mode, why = resolve_mode(w.mode)
        if why:
            print(
                f"[areal-mega] W&B: {why}: logging offline to {run_dir / 'wandb'} "
                "(upload later with `wandb sync`)",
                flush=True,
            )
        run_id = self.state.data.get("id") or runid.generate_id()
        # a service inherited from the launching process (one that used wandb itself) would
        # outlive a killed trainer with this run open: the relaunch then finds the id "in use"
        os.environ.pop("WANDB_SERVICE", None)
        if resumed and mode == "offline" and not self.state.data.get("closed", True):
            # the killed process's unflushed records are lost: keep only what the files hold
            self.state.data["last_step"] = offline_last_step(
                run_dir / "wandb", run_id, self.state.last_step
            )
        try:
            self.run = wandb.init(
                project=w.project,
                entity=w.entity or None,
                name=w.name or cfg.name,
                tags=list(w.tags) or None,
                id=run_id,
                dir=str(run_dir),
                # offline, W&B ignores `resume`; `wandb sync` joins the segments of one id
                resume="allow" if mode == "online" else None,
                mode=mode,
                config=params,
                # no metadata: it records the command line, which may carry a secret override
                settings=wandb.Settings(
                    console="off",
                    silent=True,
                    x_disable_stats=True,
                    x_disable_machine_info=True,
                    x_disable_meta=True,
                    save_code=False,
                ),
            )
        except Exception as e:  # noqa: BLE001 - re-raised with the keys that fix it
            raise ConfigError(
                f"logging.wandb: wandb.init failed ({e}); check "
                "logging.wandb.project / entity, or set logging.wandb.mode="
                "offline"
            ) from e
        if resumed and mode == "online" and not self.state.data.get("closed", True):
            # the server's history ends where the killed process's stream stopped
            self.state.data["last_step"] = min(self.state.last_step, self.run.starting_step - 1)
        self.state.save(id=run_id, mode=mode, last_step=self.state.last_step, closed=False)

    def log(self, step: int, row: dict) -> None:
        """Every finite scalar of ``row`` at ``step``; then remember ``step``."""
        self.run.log(finite_scalars(row), step=int(step))
        self.state.save(last_step=int(step))

    def log_samples(self, step: int, rows: list, name: str = "samples") -> None:
        """``rows`` as a W&B Table under ``name`` at ``step``."""
        table = wandb.Table(
            columns=["step", *COLUMNS], data=[[r.get(c) for c in ("step", *COLUMNS)] for r in rows]
        )
        self.run.log({name: table}, step=int(step), commit=False)

    def close(self) -> None:
        """Finish the W&B run (flushes the offline files)."""
        if self.run is not None:
            self.run.finish()
            self.run = None
            self.state.save(closed=True)


def offline_last_step(wandb_dir: Path, run_id: str, default: int) -> int:
    """The highest history step the offline files of ``run_id`` hold, read with W&B's own
    reader (``default`` when this wandb has none). W&B writes its offline file in blocks, so
    a killed trainer loses the steps after the last full block; those are logged again."""
    try:
        from wandb.proto import wandb_internal_pb2 as pb
        from wandb.sdk.internal import datastore
    except ImportError:
        return default
    last = -1
    for f in sorted(wandb_dir.glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")):
        ds = datastore.DataStore()
        try:
            ds.open_for_scan(str(f))
            while (data := ds.scan_data()) is not None:
                rec = pb.Record()
                rec.ParseFromString(data)
                if rec.WhichOneof("record_type") == "history":
                    last = max(
                        [last] + [int(i.value_json) for i in rec.history.item if i.key == "_step"]
                    )
        except Exception as e:  # noqa: BLE001 - a torn tail: what was read before counts
            log.info("%s: read up to a torn record (%s)", f, e)
    return last
