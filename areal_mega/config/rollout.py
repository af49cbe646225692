"""The ``rollout`` section of the experiment config: the rollout servers and how they are asked
(sampling, staleness, retries, failure policy, weight updates), the workflow and its reward, and
the online agent gateway (``rollout.online``), with their rules. The vLLM backend's own
subsection is :mod:`areal_mega.config.vllm`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from areal_mega.common.errors import ConfigError
from areal_mega.common.net import is_loopback_host
from areal_mega.config.schema import _f
from areal_mega.config.vllm import VllmConfig

__all__ = ["OnlineConfig", "RolloutConfig", "check_online", "check_rollout"]


@dataclass
class OnlineConfig:
    """The agent gateway of ``rollout.workflow: online`` (docs/workflows.md, "Online RL")."""

    host: str = _f(
        "127.0.0.1",
        doc="bind address of the gateway; beyond loopback it needs "
        "admin_api_key and tls_cert/tls_key (or allow_insecure_http)",
    )
    port: int = _f(
        0,
        lo=0,
        hi=65535,
        doc="gateway port; 0 = any free (written to <run_dir>/online_gateway.json)",
    )
    admin_api_key: Optional[str] = _f(
        None,
        doc="bearer key of /rl/start_session; unset: a "
        "random one in <run_dir>/online_gateway.json (mode 0600)",
    )
    tls_cert: str = _f("", doc="PEM certificate: serve HTTPS")
    tls_key: str = _f("", doc="PEM private key of tls_cert")
    allow_insecure_http: bool = _f(
        False,
        doc="let a non-loopback gateway serve plain HTTP "
        "(logged; session keys then travel in clear)",
    )
    session_timeout_s: float = _f(
        600.0, lo=0.0, lo_open=True, doc="an open session idle this long is dropped (idle)"
    )
    reward_timeout_s: float = _f(
        60.0,
        lo=0.0,
        lo_open=True,
        doc="an ended session with no reward this long is dropped (no_reward)",
    )
    group_timeout_s: float = _f(
        0.0,
        lo=0.0,
        doc="a task's group takes no new session after "
        "this long and trains with what it has; 0 = wait for "
        "rollout.n_samples sessions",
    )
    max_abs_reward: float = _f(
        1e6, lo=0.0, lo_open=True, doc="rewards outside +-this are refused (422)"
    )
    max_open_sessions: int = _f(1024, lo=1, doc="open sessions at most; more get 503")
    max_connections: int = _f(
        1024,
        lo=8,
        doc="HTTP connections at most (kept below the fd "
        "limit); past it the oldest idle one is closed, or 503",
    )
    idle_timeout_s: float = _f(
        30.0,
        lo=0.0,
        lo_open=True,
        doc="a connection idle this long (no request, or headers unfinished) is closed",
    )
    body_timeout_s: float = _f(
        30.0,
        lo=0.0,
        lo_open=True,
        doc="a body not received this long after its headers: 408, connection closed",
    )
    train_abandoned: bool = _f(
        False,
        doc="also train completions whose client hung up "
        "before the answer (the openai SDK retries them)",
    )


@dataclass
class RolloutConfig:
    backend: str = _f(
        "local",
        choices=["local", "sglang", "vllm"],
        doc="local: our CPU server; sglang; vllm (rollout.vllm, docs/vllm.md)",
    )
    server_addrs: list = _f(factory=list, doc="external servers host:port; empty = launch ours")
    api_key: Optional[str] = _f(
        None,
        doc="bearer key of the rollout servers; unset: "
        "AREAL_ROLLOUT_API_KEY_FILE / AREAL_ROLLOUT_API_KEY",
    )
    allow_unauthenticated: bool = _f(
        False,
        doc="let launch.local --serve-node bind servers on the network without api_key (logged)",
    )
    batch_size: int = _f(16, lo=1, doc="prompt groups per training step")
    n_samples: int = _f(8, lo=1, doc="completions per prompt (GRPO group size)")
    max_new_tokens: int = _f(512, lo=1)
    temperature: float = _f(1.0, lo=0.0)
    top_p: float = _f(1.0, lo=0.0, hi=1.0, lo_open=True)
    top_k: int = _f(-1, lo=-1)
    max_head_offpolicyness: int = _f(0, lo=0, doc="eta: staleness bound in weight versions")
    seeded_sampling: bool = _f(
        False,
        doc="seed each request's sampling from the run's seed and the sample (group, sample, "
        "turn, segment): a run started again samples the same tokens (with eta 0 the same "
        "batches; docs/ray.md compares launchers with it). Our CPU server and vLLM apply "
        "the seed; SGLang under --enable-deterministic-inference",
    )
    max_concurrent: int = _f(64, lo=1)
    request_timeout_s: float = _f(3600.0, lo=0.0, lo_open=True)
    request_retries: int = _f(3, lo=0)
    on_episode_failure: str = _f(
        "auto",
        choices=["auto", "fail", "drop"],
        doc="a prompt out of attempts: fail the run, or drop it "
        "(counted as dropped_prompts) and go on; auto: fail for "
        "rlvr and multi_turn, drop for every other workflow",
    )
    failure_rate_ceiling: float = _f(
        0.5,
        lo=0.0,
        hi=1.0,
        doc="dropped prompts: the run "
        "stops when more than this share of the last "
        "failure_window prompts was dropped (1: never)",
    )
    failure_window: int = _f(
        64,
        lo=1,
        doc="prompts (final outcomes, not attempts) over which failure_rate_ceiling is measured",
    )
    failure_min_prompts: int = _f(
        16,
        lo=1,
        doc="outcomes in the window before failure_rate_ceiling applies (<= failure_window)",
    )
    weight_update: str = _f("auto", choices=["auto", "disk", "distributed"])
    weight_bucket_mb: int = _f(512, lo=1)
    reward_fn: str = _f(
        "areal_mega.rewards:math_reward",
        doc="dotted path module:function(prompt, completion, answer, **kw)",
    )
    workflow: str = _f(
        "rlvr",
        doc="rlvr | multi_turn | online | package.module:Name | "
        "path/to/file.py:Name (docs/workflows.md)",
    )
    workflow_kwargs: dict = _f(factory=dict, doc="keyword arguments of the workflow")
    openai_port: int = _f(
        0,
        lo=0,
        hi=65535,
        doc="port of the OpenAI-compatible HTTP endpoint "
        "(started on first use by a workflow); 0 = any free port",
    )
    turn_discount: float = _f(
        1.0,
        lo=0.0,
        hi=1.0,
        doc="reward discount per later completion when an episode's calls are separate samples",
    )
    mem_fraction_static: float = _f(0.8, lo=0.0, hi=1.0, lo_open=True)
    online: OnlineConfig = field(default_factory=OnlineConfig)
    vllm: VllmConfig = field(default_factory=VllmConfig)


def check_rollout(r) -> None:
    """Rules of the ``rollout`` section ``r`` beyond single fields: the failure window, the
    form of ``rollout.workflow``, and the online gateway's exposure (:func:`check_online`)."""
    if r.failure_min_prompts > r.failure_window:
        raise ConfigError(
            f"rollout.failure_min_prompts={r.failure_min_prompts}: must be <= "
            f"rollout.failure_window ({r.failure_window})"
        )
    wf = r.workflow
    if wf not in ("rlvr", "multi_turn", "online") and not _is_object_spec(wf):
        raise ConfigError(
            f"rollout.workflow={wf!r}: must be rlvr, multi_turn, online, "
            "package.module:Name or path/to/file.py:Name"
        )
    if wf == "online":
        check_online(r.online)


def check_online(on) -> None:
    """A gateway beyond loopback needs an admin key, and TLS or the explicit opt-out."""
    if is_loopback_host(on.host):
        if bool(on.tls_cert) != bool(on.tls_key):
            raise ConfigError("rollout.online.tls_cert and rollout.online.tls_key go together")
        return
    if not on.admin_api_key:
        raise ConfigError(
            f"rollout.online.host={on.host!r} (not loopback) needs "
            "rollout.online.admin_api_key: anyone who reaches the gateway "
            "could open sessions"
        )
    if not (on.tls_cert and on.tls_key) and not on.allow_insecure_http:
        raise ConfigError(
            f"rollout.online.host={on.host!r} (not loopback) needs "
            "rollout.online.tls_cert and rollout.online.tls_key (session keys "
            "would travel in clear), or rollout.online.allow_insecure_http=true "
            "on a trusted network"
        )


def _is_object_spec(spec: str) -> bool:
    """``module:Name`` / ``file.py:Name`` in form (whether it imports is checked at start)."""
    mod, sep, name = spec.rpartition(":")
    return bool(sep and mod and name.isidentifier())
