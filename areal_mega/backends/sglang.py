"""SGLang rollout servers (GPU): ``python -m sglang.launch_server``'s command line.

The launcher (:mod:`areal_mega.launch.server_commands`) passes the TP size from the allocation
string. SGLang speaks the native HTTP API that :class:`~areal_mega.rollout.client.RolloutClient`
is written against (so does our CPU server, :mod:`areal_mega.inference`), and its servers join
the trainer's weight-update group with ``handshake="sglang"``
(:func:`areal_mega.parallel.weight_group.init_update_group`).

A vision-language checkpoint needs no flag: SGLang serves a multimodal architecture with its
multimodal processor, and a prompt's images travel as its native ``image_data`` next to the
processor-expanded ``input_ids`` (what SGLang does with them, and how the vision tokens are kept
from being sampled through ``logit_bias``: :mod:`areal_mega.rollout.generate_result`). SGLang
resizes each image into its own pixel bounds before the checkpoint's processor; an image already
at the processor's resized size (both dimensions multiples of 28, within both bounds) passes
that step unchanged, so the server's pixels equal the trainer's.
"""

from __future__ import annotations

import sys
from typing import Optional

from areal_mega.security import API_KEY_FILE_ENV, check_bind

__all__ = ["SGLANG_DTYPES", "build_sglang_command"]

SGLANG_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def build_sglang_command(
    model_path: str,
    port: int,
    *,
    host: str = "127.0.0.1",
    tp: int = 1,
    dp: int = 1,
    mem_fraction_static: float = 0.8,
    dtype: str = "bf16",
    api_key: Optional[str] = None,
    base_gpu_id: int = 0,
    random_seed: Optional[int] = None,
    extra: Optional[list] = None,
    python: str = sys.executable,
    api_key_file=None,
    allow_unauthenticated: bool = False,
) -> list:
    """The argv of ``python -m sglang.launch_server`` for one server (tp·dp GPUs).

    SGLang takes its API key only as ``--api-key`` (no environment variable), which puts it in
    ``ps``; ``api_key_file`` (a 0600 ``*.yaml`` file with ``api-key: KEY``, see
    :func:`areal_mega.security.write_sglang_key_file`) passes it as ``--config FILE`` instead,
    which SGLang merges into its arguments in-process. ``api_key`` is the argv form, for
    SGLang releases without ``--config``. A ``host`` other than loopback needs one of the two
    (ConfigError naming ``rollout.api_key``) unless ``allow_unauthenticated`` (logged)."""
    check_bind(
        host,
        authenticated=bool(api_key or api_key_file),
        what=f"SGLang server --host {host}",
        fix="set rollout.api_key (or "
        f"{API_KEY_FILE_ENV}), or rollout.allow_unauthenticated=true on a trusted network",
        allow_unauthenticated=allow_unauthenticated,
    )
    if dtype not in SGLANG_DTYPES:
        raise ValueError(f"dtype={dtype!r}: must be one of {sorted(SGLANG_DTYPES)}")
    if tp < 1 or dp < 1:
        raise ValueError(f"tp={tp}, dp={dp}: must be >= 1")
    if not 0 < mem_fraction_static <= 1:
        raise ValueError(f"mem_fraction_static={mem_fraction_static}: must be in (0, 1]")
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(tp),
        "--dp-size",
        str(dp),
        "--mem-fraction-static",
        str(mem_fraction_static),
        "--dtype",
        SGLANG_DTYPES[dtype],
        "--base-gpu-id",
        str(base_gpu_id),
        "--skip-server-warmup",
    ]
    if api_key_file:
        cmd += ["--config", str(api_key_file)]
    elif api_key:
        cmd += ["--api-key", api_key]
    if random_seed is not None:
        cmd += ["--random-seed", str(random_seed)]
    return cmd + list(extra or [])
