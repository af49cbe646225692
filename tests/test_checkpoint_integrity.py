"""Nothing loaded that was not checked: every checkpoint file carries a size and CRC-32
written at save; a shard with flipped bytes (same size) is named by ``verify_checkpoint``,
resume falls back to the previous intact checkpoint with a warning naming the file (or fails
with one error when none is left), and the HF exporter refuses it. Real checkpoints (a tiny
Qwen2 converted from HF, then two real training saves with optimizer state), real files
corrupted on disk, real processes."""

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest

from areal_mega.checkpoint import checksums as cks
from areal_mega.checkpoint.dist_ckpt import (
    CheckpointError,
    latest_verified,
    resolve_checkpoint,
    verify_checkpoint,
)
from tests.helpers.bit_flips import flip
from tests.helpers.conversions import ROOT
from tests.helpers.workers import worker_cmd, worker_env


def _worker(*args):
    p = subprocess.run(
        worker_cmd("ckpt_fault_worker", *args),
        cwd=ROOT,
        env=worker_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """``work`` (hf/, mcore/) and ``ckpts`` (iter_0000001, iter_0000002: training saves)."""
    work = tmp_path_factory.mktemp("integrity")
    res = _worker("make", work, work / "ckpts")
    return work, work / "ckpts", res["losses"]


def _root_copy(made, tmp_path):
    root = tmp_path / "ckpts"
    shutil.copytree(made[1], root)
    return root


def test_save_records_every_file(made):
    work, root, _ = made
    for ckpt in (work / "mcore" / "iter_0000000", root / "iter_0000001", root / "iter_0000002"):
        meta = verify_checkpoint(ckpt)
        files = meta["checksums"]["files"]
        assert sorted(files) == cks.list_files(ckpt)
        assert {"__0_0.distcp", ".metadata", "hf/config.json"} <= set(files)
        assert "common.pt" not in files  # megatron-core 0.19: common state inside DCP
        for rel, rec in files.items():
            assert rec == {
                "size": (ckpt / rel).stat().st_size,
                "crc32": cks.file_crc32(ckpt / rel),
            }, rel


# megatron-core 0.19 writes one DCP file per rank (its save thread_count default went 2 -> 1)
@pytest.mark.parametrize("rel", ["__0_0.distcp", ".metadata", "metadata.json", "hf/config.json"])
def test_verify_names_the_flipped_file(made, tmp_path, rel):
    root = _root_copy(made, tmp_path)
    bad = flip(root / "iter_0000002" / rel)
    for check in (
        lambda: verify_checkpoint(root / "iter_0000002"),
        lambda: resolve_checkpoint(root),
    ):
        with pytest.raises(CheckpointError, match="content checksum mismatch") as e:
            check()
        assert str(bad) in str(e.value)


def test_flipped_metadata_file_is_caught(made, tmp_path):
    root = _root_copy(made, tmp_path)
    meta = root / "iter_0000002" / "areal_meta.json"
    text = meta.read_text()
    assert '"step": 2' in text
    meta.write_text(text.replace('"step": 2', '"step": 7'))  # same size, still valid JSON
    with pytest.raises(CheckpointError, match="metadata file is corrupt") as e:
        verify_checkpoint(root / "iter_0000002")
    assert str(meta) in str(e.value)


def test_resume_falls_back_to_previous_checkpoint(made, tmp_path):
    """The trainer's resume path in a real process: latest_verified + load_checkpoint."""
    work, _, losses = made
    root = _root_copy(made, tmp_path)
    bad = flip(root / "iter_0000002" / "__0_0.distcp")
    res = _worker("resume", work, root)
    assert "error" not in res, res
    assert res["path"] == str(root / "iter_0000001") and res["iteration"] == 1
    assert res["extra"] == {"step": 1} and res["loaded_optimizer"]
    assert res["loss"] == pytest.approx(losses[1], rel=1e-6)  # the step saved after iter 1
    warned = [w for w in res["warnings"] if str(bad) in w]
    assert warned and "content checksum mismatch" in warned[0], res["warnings"]
    # moved aside (kept), `latest` rewritten: iteration 2 can be saved again
    assert (root / "iter_0000002.corrupt" / "__0_0.distcp").is_file()
    assert not (root / "iter_0000002").exists()
    assert (root / "latest").read_text().strip() == "iter_0000001"


def test_no_intact_checkpoint_left_is_one_clear_error(made, tmp_path, caplog):
    root = _root_copy(made, tmp_path)
    bad2 = flip(root / "iter_0000002" / "__0_0.distcp")
    bad1 = flip(root / "iter_0000001" / ".metadata")
    with caplog.at_level(logging.WARNING), pytest.raises(CheckpointError) as e:
        latest_verified(root)
    msg = str(e.value)
    assert "no intact checkpoint to resume from" in msg and str(root) in msg
    assert str(bad2) in msg and str(bad1) in msg
    assert any(str(bad2) in r.getMessage() for r in caplog.records)
    # nothing moved: every relaunch fails the same way instead of starting from scratch
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", "iter_0000002", "latest"]
    assert (root / "latest").read_text().strip() == "iter_0000002"


def test_latest_verified_in_process(made, tmp_path, caplog):
    root = _root_copy(made, tmp_path)
    assert latest_verified(root) == root / "iter_0000002"  # intact: no warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    bad = flip(root / "iter_0000002" / ".metadata")
    with caplog.at_level(logging.WARNING):
        assert latest_verified(root) == root / "iter_0000001"
    assert any(str(bad) in r.getMessage() for r in caplog.records)
    assert latest_verified(tmp_path / "empty") is None


def test_converter_refuses_corrupt_checkpoint(made, tmp_path):
    root = _root_copy(made, tmp_path)
    bad = flip(root / "iter_0000002" / "__0_0.distcp")
    out = tmp_path / "hf_out"
    p = subprocess.run(
        [
            sys.executable,
            "tools/convert_mcore_to_hf.py",
            "--mcore-dir",
            str(root),
            "--out",
            str(out),
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert str(bad) in p.stderr and "content checksum mismatch" in p.stderr
    assert "Traceback" not in p.stderr
    assert not out.exists() and not out.with_name("hf_out.tmp").exists()


def test_checkpoint_without_checksums_loads_with_a_warning(made, tmp_path, caplog):
    """Checkpoints written before checksums existed still verify (sizes only), with a warning
    naming them, so running jobs keep resuming; a truncated shard is still refused."""
    root = _root_copy(made, tmp_path)
    ckpt = root / "iter_0000002"
    meta = json.loads((ckpt / "areal_meta.json").read_text())
    del meta["checksums"]
    (ckpt / "areal_meta.json").write_text(json.dumps(meta))
    with caplog.at_level(logging.WARNING):
        assert verify_checkpoint(ckpt)["iteration"] == 2
    assert any(
        str(ckpt / "areal_meta.json") in r.getMessage()
        and "without content checksums" in r.getMessage()
        for r in caplog.records
    )
    shard = ckpt / "__0_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 10)
    with pytest.raises(CheckpointError, match="truncated") as e:
        verify_checkpoint(ckpt)
    assert str(shard) in str(e.value)


def test_checksum_truncation_is_named_as_such(made, tmp_path):
    root = _root_copy(made, tmp_path)
    shard = root / "iter_0000001" / "__0_0.distcp"
    os.truncate(shard, shard.stat().st_size - 1)
    with pytest.raises(CheckpointError, match="truncated checkpoint shard") as e:
        verify_checkpoint(root / "iter_0000001")
    assert str(shard) in str(e.value)
