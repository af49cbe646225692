"""The run directory: its layout, and the questions every process of a run asks of it.

The trainer, the rollout worker and the launcher all find their files and sockets here, so
the layout is written down once (no torch, no megatron: any process may import it)::

    <run_dir>/config.yaml            the launcher's resolved config (what every process reads)
    <run_dir>/config.resolved.json   the trainer's view of it (both 0600 when they hold a secret)
    <run_dir>/sglang-api-key.yaml    0600, rollout.api_key for SGLang's --config (not on argv)
    <run_dir>/checkpoints/iter_NNNNNNN/   complete once areal_meta.json (written last) exists
    <run_dir>/checkpoints/latest     name of the newest complete checkpoint
    <run_dir>/journal/NNNNNNNN.journal    accepted trajectories a kept checkpoint may need
    <run_dir>/init_mcore[_ref]/      the HF model converted once at the start of the run
    <run_dir>/rollout_state.json     the rollout worker's prompt position
    <run_dir>/rollout_servers.json   the rollout servers now (elastic rollout, launch.scale)
    <run_dir>/weights/vNNNNNNN/      the newest published HF weights (disk weight updates)
    <run_dir>/fatal.json             why the run stopped for good (no relaunch helps)
    <run_dir>/metrics.jsonl, trained.jsonl, tensorboard/, logs/
    ipc://<run_dir>/trajectories.sock, ipc://<run_dir>/control.sock   default endpoints
    ipc://<run_dir>/launcher.sock    launch.local's control socket (launch.scale)

``checkpoint.dir`` and the ``dataplane`` endpoints override the defaults. A socket whose path
in a deep run directory would be too long for a Unix socket address lies in the temporary
directory instead, named after the run directory (:func:`socket_endpoint`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from areal_mega.dataplane.journal import TrajectoryJournal

log = logging.getLogger(__name__)

#: The longest ipc path of ours (a Unix socket address holds 107 bytes on Linux).
IPC_PATH_MAX = 100


def socket_endpoint(root: Path, name: str) -> str:
    """``ipc://<root>/<name>``, or where that path is longer than :data:`IPC_PATH_MAX`, the
    socket ``areal-mega-<digest of root>-<name>`` in the temporary directory (``/tmp`` if that
    is too deep too): the same endpoint in every process of the run on this machine."""
    path = f"{root}/{name}"
    if len(path) > IPC_PATH_MAX:
        leaf = f"areal-mega-{hashlib.sha256(str(root).encode()).hexdigest()[:16]}-{name}"
        path = os.path.join(tempfile.gettempdir(), leaf)
        if len(path) > IPC_PATH_MAX:
            path = f"/tmp/{leaf}"
    return f"ipc://{path}"


META_NAME = "areal_meta.json"
"""Written last into a checkpoint directory: its presence marks the checkpoint complete."""
ITER_RE = re.compile(r"^iter_(\d{7,})$")
WEIGHTS_RE = re.compile(r"^v(\d{7,})$")
FATAL_EXIT_CODE = 78
"""A trainer or rollout worker that stops for a reason no relaunch cures (a full disk, the
failure-rate ceiling) exits with this code and writes :attr:`RunDir.fatal_file`;
``launch.local`` then ends the run instead of relaunching."""


def iter_dir_name(iteration: int) -> str:
    """``iter_0000042``: the directory name of the checkpoint saved after step ``iteration``."""
    return f"iter_{int(iteration):07d}"


def checkpoint_iteration(ckpt) -> int:
    """The step a checkpoint directory ``iter_NNNNNNN`` was saved after."""
    m = ITER_RE.match(Path(ckpt).name)
    if m is None:
        raise ValueError(f"{ckpt}: not a checkpoint directory name (iter_NNNNNNN)")
    return int(m.group(1))


def complete_checkpoints(root) -> List[Path]:
    """Every complete ``iter_*`` checkpoint under ``root``, oldest first."""
    root = Path(root)
    out = [
        p
        for p in (root.iterdir() if root.is_dir() else [])
        if p.is_dir() and ITER_RE.match(p.name) and (p / META_NAME).is_file()
    ]
    return sorted(out, key=lambda p: int(ITER_RE.match(p.name).group(1)))


def find_latest(root) -> Optional[Path]:
    """The newest complete checkpoint under ``root`` (the highest complete ``iter_*``), or
    None when there is none.

    A save renames ``iter_N.tmp`` to ``iter_N`` and then moves the ``latest`` pointer: a
    process stopped between the two (``scancel`` lands there easily with ``save_every=1``)
    leaves the pointer one save behind a complete checkpoint. Resuming from the pointer would
    train step N again and then refuse to overwrite ``iter_N``, on every relaunch; so the
    newest complete directory wins, and a pointer that disagrees is reported."""
    root = Path(root)
    done = complete_checkpoints(root)
    ptr = root / "latest"
    if ptr.is_file():
        named = ptr.read_text().strip()
        if not (done and named == done[-1].name):
            log.warning(
                "%s names %s; the newest complete checkpoint is %s (a save cut short "
                "before its pointer moved, or a pointer at an incomplete one)",
                ptr,
                named,
                done[-1].name if done else "none",
            )
    return done[-1] if done else None


def checkpoint_meta(ckpt) -> dict:
    """The parsed ``areal_meta.json`` of a checkpoint directory (no shard checks: see
    :func:`areal_mega.checkpoint.dist_ckpt.verify_checkpoint` for those)."""
    path = Path(ckpt) / META_NAME
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable checkpoint metadata ({e})") from None


LOW_SPACE_BYTES = 16 << 20
"""Below this many free bytes a filesystem counts as full (a write failure there is ENOSPC)."""


def free_bytes(path) -> Optional[int]:
    """Free bytes on the filesystem holding ``path`` (or its nearest existing parent)."""
    p = Path(path).resolve()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def is_disk_full_error(exc: BaseException, path) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a write that failed for want
    of space under ``path``: errno ENOSPC/EDQUOT or their message anywhere in the chain, or a
    failed write on a filesystem that :func:`free_bytes` confirms is (nearly) full. A failed
    write is PyTorch's ``inline_container`` "file write failed", or megatron-core's DCP writer
    reporting a "Worker failure" (since 0.19 its single-thread writer logs the worker's error and
    raises one that names only the error's type, so the errno is lost)."""
    seen, e, write_failed = set(), exc, False
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text:
            return True
        write_failed |= any(
            s in text for s in ("inline_container", "write failed", "Worker failure")
        )
        e = e.__cause__ or e.__context__
    if not write_failed:
        return False
    free = free_bytes(path)
    return free is not None and free < LOW_SPACE_BYTES


def hf_source_identity(hf_dir, **conversion) -> dict:
    """What an ``init_mcore`` conversion was made from: the HF directory (resolved), a hash
    of its ``config.json``, the name/size/mtime of every weight file, and the conversion
    settings. A cached conversion whose identity differs is stale."""
    import hashlib

    root = Path(hf_dir).resolve()
    cfg = root / "config.json"
    weights = (
        sorted(
            p
            for p in root.iterdir()
            if p.suffix in (".safetensors", ".bin", ".pt") or p.name.endswith(".index.json")
        )
        if root.is_dir()
        else []
    )
    return {
        "hf_dir": str(root),
        "config_sha256": hashlib.sha256(cfg.read_bytes()).hexdigest() if cfg.is_file() else None,
        "weights": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights],
        "conversion": conversion,
    }


SOURCE_FILE = "source.json"
"""Inside an ``init_mcore`` directory: the :func:`hf_source_identity` it was converted from."""


@dataclass(frozen=True)
class RunDir:
    """Paths and endpoints of one run, derived from the config in one place."""

    root: Path
    checkpoint_root: Path
    data_endpoint: str
    control_endpoint: str

    @classmethod
    def from_config(cls, cfg) -> "RunDir":
        """The run directory of ``cfg`` (an :class:`~areal_mega.config.ExperimentConfig`)."""
        root = Path(cfg.logging.run_dir).resolve()
        return cls(
            root=root,
            checkpoint_root=Path(cfg.checkpoint.dir).resolve()
            if cfg.checkpoint.dir
            else root / "checkpoints",
            data_endpoint=cfg.dataplane.endpoint or socket_endpoint(root, "trajectories.sock"),
            control_endpoint=(
                cfg.dataplane.control_endpoint or socket_endpoint(root, "control.sock")
            ),
        )

    @property
    def config_file(self) -> Path:
        return self.root / "config.yaml"

    @property
    def rollout_servers_file(self) -> Path:
        """The job's rollout server addresses now (``launch.local`` rewrites it as servers join
        and leave; a relaunched rollout worker reads it)."""
        return self.root / "rollout_servers.json"

    def rollout_server_addrs(self, default: list) -> list:
        """The addresses in :attr:`rollout_servers_file`, or ``default`` without one."""
        f = self.rollout_servers_file
        if not f.is_file():
            return list(default)
        addrs = json.loads(f.read_text()).get("addrs")
        if not isinstance(addrs, list) or not addrs:
            raise ValueError(f"{f}: field 'addrs' must be a non-empty list of host:port")
        return [str(a) for a in addrs]

    @property
    def launcher_endpoint(self) -> str:
        """``launch.local``'s own control socket (``launch.scale`` adds / removes servers)."""
        return socket_endpoint(self.root, "launcher.sock")

    @property
    def resolved_config_file(self) -> Path:
        return self.root / "config.resolved.json"

    @property
    def sglang_key_file(self) -> Path:
        return self.root / "sglang-api-key.yaml"

    @property
    def journal(self) -> Path:
        return self.root / "journal"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def rollout_state(self) -> Path:
        return self.root / "rollout_state.json"

    @property
    def weights_root(self) -> Path:
        return self.root / "weights"

    def weights_dir(self, version: int) -> Path:
        """Where the trainer publishes the HF weights of ``version`` (disk weight updates)."""
        return self.weights_root / f"v{int(version):07d}"

    def latest_weights(self) -> Optional[tuple]:
        """``(version, path)`` of the newest complete published weights directory, or None.
        Directories are written as ``vN.tmp`` and renamed, so a listed one is complete."""
        found = [
            (int(m.group(1)), p)
            for p in (self.weights_root.iterdir() if self.weights_root.is_dir() else [])
            if (m := WEIGHTS_RE.match(p.name)) and p.is_dir()
        ]
        return max(found) if found else None

    @property
    def fatal_file(self) -> Path:
        return self.root / "fatal.json"

    def write_fatal(self, message: str) -> None:
        """Record why the run stopped for good (best effort: the disk may be full)."""
        try:
            self.fatal_file.write_text(json.dumps({"message": message}) + "\n")
        except OSError as e:
            log.warning("cannot write %s: %s", self.fatal_file, e)

    def read_fatal(self) -> Optional[str]:
        """The message :meth:`write_fatal` recorded, or None."""
        try:
            return str(json.loads(self.fatal_file.read_text())["message"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def init_checkpoint(self, reference: bool = False) -> Path:
        """Where the initial HF weights are converted to (the reference model's own, if any)."""
        return self.root / ("init_mcore_ref" if reference else "init_mcore")

    def init_checkpoint_is_current(self, init_dir: Path, identity: dict) -> bool:
        """Whether the converted initial checkpoint ``init_dir`` is complete and was made from
        exactly ``identity`` (see :func:`hf_source_identity`)."""
        marker = Path(init_dir) / SOURCE_FILE
        if find_latest(init_dir) is None or not marker.is_file():
            return False
        try:
            return json.loads(marker.read_text()) == identity
        except (OSError, json.JSONDecodeError):
            return False

    def latest_checkpoint(self) -> Optional[Path]:
        """The checkpoint a ``recover=auto`` trainer resumes from, or None."""
        return find_latest(self.checkpoint_root)

    def earlier_run_state(self) -> List[str]:
        """What an earlier run left here that a fresh start (``recover=off``) would collide
        with: complete checkpoints, metrics records, journal segments. Empty for a new run
        directory (the launcher's ``config.yaml`` and the ``init_mcore`` cache do not count)."""
        found = []
        ckpts = complete_checkpoints(self.checkpoint_root)
        if ckpts:
            found.append(f"{len(ckpts)} checkpoint(s) up to {ckpts[-1]}")
        metrics = self.root / "metrics.jsonl"
        if metrics.is_file() and metrics.stat().st_size > 0:
            found.append(f"step records in {metrics}")
        segments = [p for p in sorted(self.journal.glob("*.journal")) if p.stat().st_size > 0]
        if segments:
            found.append(f"{len(segments)} journal segment(s) in {self.journal}")
        return found

    def check_fresh_start(self, recover: str) -> None:
        """Refuse ``recover=off`` in a run directory an earlier run has used: it would train
        from scratch, interleave its metrics with the old ones and collide with the old
        checkpoints at the first save. Raises ``ValueError`` saying what was found."""
        found = self.earlier_run_state() if recover == "off" else []
        if found:
            raise ValueError(
                f"logging.run_dir={self.root} was used by an earlier run ({'; '.join(found)}) "
                f"and recover=off would start over on top of it: resume it with recover=auto, "
                f"or choose a new logging.run_dir (or delete this one)"
            )

    def accepted_samples(self, ckpt: Optional[Path]) -> int:
        """Samples the trainer has accepted in this run's lineage: those counted by checkpoint
        ``ckpt`` (the one it resumes from; None for a fresh start) plus those in the journal
        segments written since."""

        before = 0
        if ckpt is not None:
            before = int(checkpoint_meta(ckpt).get("extra", {}).get("accepted_samples", 0))
        return before + sum(1 for _ in self.journal_since(ckpt))

    def journal_since(self, ckpt: Optional[Path], stats=None):
        """The journaled trajectories accepted after checkpoint ``ckpt`` (its
        ``journal_from`` segment on; every segment for None or a checkpoint that predates the
        record), corrupt records skipped and counted in ``stats``."""
        since = None
        if ckpt is not None:
            since = checkpoint_meta(ckpt).get("extra", {}).get("journal_from")
        return TrajectoryJournal.replay(self.journal, stats, since=since)
