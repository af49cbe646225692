"""SGLang server command for the launcher (``launch/local.py`` calls
:func:`build_server_command`); the flags themselves are built in
:func:`areal_mega.rollout.launch.build_sglang_command`."""
from __future__ import annotations

from areal_mega.rollout.launch import build_sglang_command


def build_server_command(cfg, slot, host: str = "127.0.0.1") -> list:
    """argv of ``python -m sglang.launch_server`` for one server slot (``slot.port``; its GPUs
    are exported as ``CUDA_VISIBLE_DEVICES`` by the launcher, so GPU ids start at 0).
    TP size is ``rollout.sglang_tp``; dtype follows ``model.dtype``."""
    return build_sglang_command(
        cfg.model.path, slot.port, host=host, tp=cfg.rollout.sglang_tp, dp=1,
        mem_fraction_static=cfg.rollout.mem_fraction_static, dtype=cfg.model.dtype,
        api_key=cfg.rollout.api_key, base_gpu_id=0, random_seed=cfg.seed)
