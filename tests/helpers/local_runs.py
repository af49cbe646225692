"""A ``launch.local`` run of the tiny-cpu recipe as the end-to-end tests drive it: start and
finish it, read what it wrote (metrics, trained samples, accepted sample ids), find its live
processes, check a preset's run, and bring a rollout server that several runs join
(``rollout.server_addrs``) back to what a server launch.local starts holds."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from areal_mega.config import PRESETS
from areal_mega.dataplane.buffer import TrajectoryBuffer
from areal_mega.dataplane.journal import TrajectoryJournal
from tests.helpers.workers import ROOT


def run_overrides(run_dir, model, data) -> list:
    """The tiny-cpu recipe's overrides every end-to-end run starts from (``_launch``'s, and
    those of a command the test hands to another launcher, e.g. ``ray job submit``)."""
    return [
        f"model.path={model}",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.test_path={data / 'test.jsonl'}",
        f"logging.run_dir={run_dir}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "rollout.batch_size=4",
        "rollout.n_samples=4",
        "cluster.kill_grace_s=5",
    ]


def _launch(run_dir, model, data, *extra, module="areal_mega.launch.local", env=None):
    """``launch.local`` (or another launcher ``module``, e.g. ``launch.ray``, with ``env``
    added) on the tiny-cpu recipe, ``extra`` overrides last. No reward-curve PNG
    unless ``extra`` asks (``logging.plot=true``): drawing it takes a second per run and is
    checked in tests/test_e2e_multitask.py and tests/test_eval_training.py."""
    args = [
        sys.executable,
        "-m",
        module,
        "--config",
        str(ROOT / "recipes" / "tiny-cpu.yaml"),
        *run_overrides(run_dir, model, data),
        *extra,
    ]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.Popen(
        args,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _finish(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail("launch.local did not finish:\n" + out.decode()[-3000:])
    return proc.returncode, out.decode()


def _metrics(run_dir):
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _trained(run_dir):
    path = Path(run_dir) / "trained.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _trainer_pid(run_dir):
    """The trainer rank of THIS run (its command line names the run's config), never another
    run's on the same machine."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if (
            "areal_mega.trainer" in cmd
            and "torch.distributed.run" not in cmd
            and f"{run_dir}/config.yaml" in cmd
        ):
            return p.pid
    return None


def _snapshot_live_run(run_dir, dest):
    """Copy a running run's directory (its journal and pending buffers: what was accepted so
    far) to ``dest``, without checkpoints, weights or sockets; an atomic write's *.tmp file
    may vanish while the tree is copied, so those are skipped, as a file removed while it is
    copied."""
    ignore = shutil.ignore_patterns(
        "*.sock", "iter_*", "weights", "init_mcore", "tensorboard", "*.tmp"
    )
    # a checkpoint's buffer file is pruned once a newer one is written, so a file listed may
    # be gone when it is copied; the second pass picks up what was written meanwhile
    for _ in range(2):
        shutil.copytree(
            run_dir, dest, ignore=ignore, copy_function=_copy_if_present, dirs_exist_ok=True
        )
    return dest


def _copy_if_present(src, dst):
    """``shutil.copy2`` that skips a file removed after its directory was listed."""
    try:
        return shutil.copy2(src, dst)
    except FileNotFoundError:
        return dst


def _accepted_ids(run_dir):
    """Sample ids the trainer has accepted: trained, pending in checkpointed buffers, or in
    the journal segments."""
    run_dir = Path(run_dir)
    ids = {s for rec in _trained(run_dir) for s in rec["sample_ids"]}
    for f in (run_dir / "checkpoints").glob("buffer_iter_*.bin"):
        ids |= {t.sample_id for t in TrajectoryBuffer.load(str(f)).pending()}
    ids |= {t.sample_id for t in TrajectoryJournal.replay(run_dir / "journal")}
    return ids


def _server_ports(run_dir) -> list:
    """The ports of ``rollout.server_addrs`` in the config the launcher wrote (parsed, not
    searched for: other sections have a ``server_addrs`` too, e.g. ``teacher``)."""
    cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    return [str(a).rsplit(":", 1)[1] for a in cfg["rollout"]["server_addrs"]]


def _server_proc(port):
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "areal_mega.inference.server" in " ".join(cmd) and str(port) in cmd:
            return p
    return None


def _wait(cond, proc, what, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, (
            f"launch.local exited while waiting for {what}:\n" + proc.stdout.read().decode()[-3000:]
        )
        v = cond()
        if v:
            return v
        time.sleep(0.3)
    pytest.fail(f"timed out waiting for {what}")


def fresh_server(addr, model) -> str:
    """The CPU rollout server at ``addr`` brought back to what one that launch.local starts on
    ``model`` holds: ``model``'s weights at version 0, generating (a run may have ended while
    it was paused for a weight update). Returns ``addr``."""
    import asyncio

    from areal_mega.rollout.client import RolloutClient

    async def reset():
        c = RolloutClient([addr], timeout_s=60, retries=1)
        try:
            await c.update_weights_from_disk(str(model), weight_version=0)
            await c.resume()
            return await c.model_info()
        finally:
            await c.close()

    assert asyncio.run(asyncio.wait_for(reset(), 120))["weight_version"] == "0"
    return addr


def server_addrs_on(srv, model) -> str:
    """``rollout.server_addrs`` of a launch that joins the module's shared server ``srv``,
    brought back first to a fresh server's state (:func:`fresh_server`)."""
    return f"rollout.server_addrs=[{fresh_server(srv.addr, model)}]"


def check_preset_run(run, preset, steps):
    """``preset``'s keys reached the trainer (the run's resolved config) and the run's
    ``steps`` steps logged finite losses (none on a step the dynamic filter emptied)."""
    resolved = json.loads((run / "config.resolved.json").read_text())
    assert resolved["algorithm"]["preset"] == preset
    for key, value in PRESETS[preset].items():
        section, leaf = key.split(".", 1)
        assert resolved[section][leaf] == value, key
    rows = _metrics(run)
    assert [r["step"] for r in rows if r["step"] >= 1] == list(range(1, steps + 1))
    for r in rows:  # a step the dynamic filter emptied takes no optimizer step, has no loss
        if r["step"] >= 1:
            assert math.isfinite(r["loss"]) if r["n_samples"] > 0 else "loss" not in r, r
