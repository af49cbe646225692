"""tools/pip_sources.sh: the Makefile's uv installs take the sources and constraints pip has."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pairs(tmp_path, config_file, **env_vars):
    """The flags tools/pip_sources.sh prints, as (flag, value) pairs, with only ``config_file`` (or
    no file at all for os.devnull) and ``env_vars`` configuring pip."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(config_file), HOME=str(tmp_path), **env_vars)
    out = subprocess.run(
        [str(ROOT / "tools" / "pip_sources.sh"), sys.executable],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    flags = out.stdout.split()
    return list(zip(flags[::2], flags[1::2]))


def test_environment_variables_become_uv_flags(tmp_path):
    pairs = _pairs(
        tmp_path,
        os.devnull,
        PIP_FIND_LINKS="/opt/wheels",
        PIP_EXTRA_INDEX_URL="file:///a/simple file:///b/simple",
        PIP_CONSTRAINT="/etc/c.txt",
        PIP_INDEX_URL="https://mirror.example/simple",
        PIP_DEFAULT_TIMEOUT="180",
    )
    assert sorted(pairs) == sorted(
        [
            ("--find-links", "/opt/wheels"),
            ("--extra-index-url", "file:///a/simple"),
            ("--extra-index-url", "file:///b/simple"),
            ("--constraint", "/etc/c.txt"),
            ("--index-url", "https://mirror.example/simple"),
        ]
    )


def test_a_config_file_is_read_and_a_value_set_twice_is_passed_once(tmp_path):
    config = tmp_path / "pip.conf"
    config.write_text(
        "[global]\nfind-links = /opt/wheels\nconstraint = /etc/c.txt\ntimeout = 60\n"
        "[install]\nno-compile = true\n"
    )
    pairs = _pairs(tmp_path, config, PIP_FIND_LINKS="/opt/wheels")
    assert pairs.count(("--find-links", "/opt/wheels")) == 1
    assert ("--constraint", "/etc/c.txt") in pairs
    assert not [
        flag
        for flag, _ in pairs
        if flag not in ("--find-links", "--extra-index-url", "--index-url", "--constraint")
    ]


def test_no_pip_configuration_gives_no_flags(tmp_path):
    assert _pairs(tmp_path, os.devnull) == []
