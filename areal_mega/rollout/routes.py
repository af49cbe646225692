"""Routed experts of one ``/generate`` call, decoded for the trajectory (routing replay,
``algorithm.routing_replay: r3``; formats in :mod:`areal_mega.common.moe_routes`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from areal_mega.common.errors import ConfigError
from areal_mega.common.moe_routes import RouteLayout, decode_sglang_routes
from areal_mega.models.moe_families import EXPERT_BIAS_ROUTER_MODEL_TYPES
from areal_mega.rollout.generate_result import GenerateResult, RolloutRequestError


def call_routes(
    res: GenerateResult, n_input: int, layout: RouteLayout, start: int = 0
) -> Optional[tuple]:
    """``(rows, first position)``: the routes of the tokens this call forwarded, positions
    ``first .. n_input + len(res.output_ids) - 2`` from the start of its input, where ``first``
    is the call's ``routed_experts_start_len`` (``start``) or 0 from a server that returns the
    whole sequence regardless; None for a call that forwarded nothing (aborted before its
    prefill: no output, and SGLang then returns no routes). :class:`RolloutRequestError` when
    the server left them out of an answer that has output (a server started without
    ``--enable-return-routed-experts``) or sent a wrong size."""
    end = n_input + len(res.output_ids) - 1
    if res.routed_experts is None:
        if not res.output_ids:
            return None
        raise RolloutRequestError(
            f"{res.server}/generate: no meta_info.routed_experts in the answer although the "
            "request asked for them (algorithm.routing_replay is on); start the rollout "
            "servers with --enable-return-routed-experts"
        )
    try:
        rows = decode_sglang_routes(res.routed_experts, layout)
    except ValueError as e:
        raise RolloutRequestError(f"{res.server}/generate: {e}") from None
    for first in (start, 0):
        if len(rows) == end - first:
            return rows, first
    raise RolloutRequestError(
        f"{res.server}/generate: meta_info.routed_experts has "
        f"{len(rows)} tokens, expected {end - start} (from position "
        f"{start}) or {end}"
    )


def _model_type(model_path) -> Optional[str]:
    """``model_type`` of ``<model_path>/config.json`` (None without one)."""
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()).get("model_type") if path.is_file() else None


def replay_layout(cfg) -> Optional[RouteLayout]:
    """The route layout of ``model.path`` when ``algorithm.routing_replay`` is on (the rollout
    then asks every ``/generate`` for routes), else None. :class:`ConfigError` naming the key
    when the model has no MoE layers."""
    if cfg.algorithm.routing_replay == "off":
        return None
    model_type = _model_type(cfg.model.path)
    if model_type in EXPERT_BIAS_ROUTER_MODEL_TYPES:
        raise ConfigError(
            f"algorithm.routing_replay={cfg.algorithm.routing_replay!r}: "
            f"model_type {model_type!r} routes with an expert bias (on sigmoid scores; "
            "Ernie 4.5's on softmax scores), which the rollout servers' route capture does "
            "not cover; set algorithm.routing_replay=off"
        )
    layout = RouteLayout.from_model_path(cfg.model.path)
    if layout is None:
        raise ConfigError(
            f"algorithm.routing_replay={cfg.algorithm.routing_replay!r}: "
            f"model.path={cfg.model.path!r} has no mixture-of-experts layers "
            "(config.json without num_experts / num_experts_per_tok); set "
            "algorithm.routing_replay=off"
        )
    return layout


def replay_server_flags(cfg) -> list:
    """The rollout servers' extra flags for ``algorithm.routing_replay`` (SGLang's and the CPU
    server's spelling is the same)."""
    return [] if cfg.algorithm.routing_replay == "off" else ["--enable-return-routed-experts"]
