"""The ``rollout.vllm`` section of the experiment config (``rollout.backend: vllm``, docs/vllm.md)
and the rules a vLLM rollout must follow. Pure: no vllm, no torch; the launcher builds the
command line from it (:mod:`areal_mega.backends.vllm.launch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from areal_mega.common.errors import ConfigError
from areal_mega.config.schema import _f

__all__ = ["VllmConfig", "check_vllm", "MANAGED_VLLM_FLAGS"]


@dataclass
class VllmConfig:
    python: str = _f(
        "",
        doc="the interpreter that has vLLM (its own venv: vLLM pins its own "
        "torch); empty: $AREAL_VLLM_PYTHON, else <repository>/.venv-vllm/bin/"
        "python (make vllm-env builds it)",
    )
    kv_cache_gib: float = _f(
        1.0,
        lo=0.0,
        lo_open=True,
        doc="CPU only: KV cache size in whole "
        "GiB (VLLM_CPU_KVCACHE_SPACE); on GPU the cache is "
        "gpu_memory_utilization's share",
    )
    enforce_eager: bool = _f(
        True,
        doc="--enforce-eager: no CUDA graphs / torch.compile (fast "
        "start; false: faster decoding after a longer start)",
    )
    max_model_len: int = _f(
        0,
        lo=0,
        doc="--max-model-len; 0 = vLLM's default (the model's context from its config.json)",
    )
    gpu_memory_utilization: Optional[float] = _f(
        None,
        lo=0.0,
        hi=1.0,
        lo_open=True,
        doc="--gpu-memory-utilization on GPU; None = rollout.mem_fraction_static",
    )
    extra_args: list = _f(
        factory=list,
        doc="more vLLM server flags, e.g. [--max-num-seqs, "
        "'64']; the flags the launcher sets (MANAGED_VLLM_FLAGS) are refused",
    )


#: flags the launcher passes itself, with the key (or reason) that decides each; in
#: ``rollout.vllm.extra_args`` they are refused (a second value would silently win in vLLM's
#: argparse, e.g. a TP size that the weight-update group does not expect)
MANAGED_VLLM_FLAGS = {
    "--model": "model.path",
    "--host": "the launcher (loopback, or 0.0.0.0 for --serve-node)",
    "--port": "the launcher (a free port, or cluster.server_base_port + k)",
    "--tensor-parallel-size": "the allocation's rollout t",
    "-tp": "the allocation's rollout t",
    "--pipeline-parallel-size": "the allocation's rollout p",
    "-pp": "the allocation's rollout p",
    "--data-parallel-size": "the allocation's rollout d (one server each)",
    "-dp": "the allocation's rollout d (one server each)",
    "--dtype": "model.dtype",
    "--seed": "seed (+ the server's index)",
    "--logprobs-mode": "the trainer's logprob convention (processed_logprobs, always)",
    "--worker-extension-cls": "the weight-sync extension (always)",
    "--served-model-name": "the launcher (one name the client sends)",
    "--max-model-len": "rollout.vllm.max_model_len",
    "--enforce-eager": "rollout.vllm.enforce_eager",
    "--no-enforce-eager": "rollout.vllm.enforce_eager",
    "--gpu-memory-utilization": "rollout.vllm.gpu_memory_utilization",
    "--api-key": "rollout.api_key (handed over as VLLM_API_KEY, never on a command line)",
}


def _flag_name(arg: str) -> str:
    """``--max_model_len=8`` -> ``--max-model-len`` (vLLM's parser takes either spelling)."""
    name = arg.split("=", 1)[0]
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def check_vllm(cfg) -> None:
    """Cross-field rules of ``rollout.backend=vllm`` (pure; raises :class:`ConfigError` naming
    the key): what the vLLM servers do not serve here (LoRA adapters, routing replay),
    sampling whose logprobs would differ from the trainer's, whole GiB of CPU KV cache, and
    ``rollout.vllm.extra_args`` without the flags the launcher owns."""
    if cfg.rollout.backend != "vllm":
        return
    v = cfg.rollout.vllm
    if cfg.lora.enabled:
        raise ConfigError(
            "rollout.backend=vllm: LoRA adapters are served only by sglang/local "
            "here (lora.enabled=true); set rollout.backend=sglang or local, or "
            "lora.enabled=false"
        )
    if cfg.algorithm.routing_replay != "off":
        raise ConfigError(
            f"algorithm.routing_replay={cfg.algorithm.routing_replay!r} with "
            "rollout.backend=vllm: the vLLM servers do not return the routed "
            "experts here; use rollout.backend=sglang or local, or "
            "algorithm.routing_replay=off"
        )
    r = cfg.rollout
    if cfg.mode == "rl" and (r.top_p < 1.0 or r.top_k > 0):
        raise ConfigError(
            f"rollout.top_p={r.top_p}, rollout.top_k={r.top_k} with "
            "rollout.backend=vllm: vLLM's processed logprobs are taken after "
            "top-k/top-p renormalisation, the trainer's (and SGLang's) after "
            "temperature only, so the behaviour logprobs would be off by the "
            "log of the kept mass; use rollout.top_p=1 and rollout.top_k=-1 "
            "with vllm, or rollout.backend=sglang"
        )
    if not float(v.kv_cache_gib).is_integer():
        raise ConfigError(
            f"rollout.vllm.kv_cache_gib={v.kv_cache_gib}: vLLM's CPU KV cache "
            "(VLLM_CPU_KVCACHE_SPACE) is a whole number of GiB; use 1 or more"
        )
    for i, arg in enumerate(v.extra_args):
        if isinstance(arg, bool) or not isinstance(arg, (str, int, float)):
            raise ConfigError(
                f"rollout.vllm.extra_args[{i}]={arg!r}: each item is one "
                "command-line word (a string or a number)"
            )
        owner = MANAGED_VLLM_FLAGS.get(_flag_name(str(arg)))
        if owner is not None:
            raise ConfigError(
                f"rollout.vllm.extra_args[{i}]={arg!r}: the launcher sets "
                f"{_flag_name(str(arg))} itself (from {owner}); remove it"
            )
