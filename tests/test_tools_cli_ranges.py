"""Every numeric argument of the tools/ scripts is range-checked by argparse: a bad value is
one line naming the flag and exit code 2, never a traceback (``--tp 0`` used to end in a
ZeroDivisionError). Real processes, real model directory."""

import subprocess
import sys

import pytest

from tests.helpers.conversions import ROOT


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from areal_mega.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("cli") / "llama", arch="llama")


def _run(script, args):
    return subprocess.run(
        [sys.executable, f"tools/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _assert_refused(p, flag, words):
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    assert f"argument {flag}:" in p.stderr, p.stderr
    for w in words:
        assert w in p.stderr, (w, p.stderr)


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--tp", "0", [">= 1"]),
        ("--pp", "-1", [">= 1"]),
        ("--ep", "0", [">= 1"]),
        ("--vpp", "0", [">= 1"]),
        ("--make-vocab-size-divisible-by", "0", [">= 1"]),
        ("--tp", "two", ["not an integer"]),
    ],
)
def test_convert_hf_to_mcore_ranges(tiny, tmp_path, flag, value, words):
    p = _run(
        "convert_hf_to_mcore.py",
        ["--hf-dir", str(tiny), "--out", str(tmp_path / "o"), "--no-progress", flag, value],
    )
    _assert_refused(p, flag, words)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "value, words",
    [
        ("0", ["> 0"]),
        ("-1", ["> 0"]),
        ("inf", ["finite"]),
        ("nan", ["finite"]),
        ("big", ["not a number"]),
    ],
)
def test_convert_mcore_to_hf_ranges(tmp_path, value, words):
    p = _run(
        "convert_mcore_to_hf.py",
        [
            "--mcore-dir",
            str(tmp_path / "m"),
            "--out",
            str(tmp_path / "o"),
            "--max-shard-size",
            value,
        ],
    )
    _assert_refused(p, "--max-shard-size", words)


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--hidden-size", "0", [">= 1"]),
        ("--num-layers", "-1", [">= 1"]),
        ("--num-heads", "0", [">= 1"]),
        ("--seed", "-1", [">= 0"]),
        ("--rms-norm-eps", "nan", ["finite"]),
        ("--rope-theta", "inf", ["finite"]),
        ("--initializer-range", "0", ["> 0"]),
    ],
)
def test_make_tiny_model_ranges(tmp_path, flag, value, words):
    p = _run("make_tiny_model.py", ["--arch", "llama", "--out", str(tmp_path / "o"), flag, value])
    _assert_refused(p, flag, words)
    assert not (tmp_path / "o").exists()


def test_valid_numbers_still_work(tmp_path):
    p = _run(
        "make_tiny_model.py",
        [
            "--arch",
            "llama",
            "--out",
            str(tmp_path / "o"),
            "--hidden-size",
            "32",
            "--seed",
            "0",
            "--rope-theta",
            "1e4",
        ],
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert (tmp_path / "o" / "config.json").is_file()
