"""Loading a published version into the rollout servers: full weights or a LoRA adapter.

The trainer publishes each version as a directory (``<run>/weights/v<N>``): an HF model, or
with ``lora.sync: adapter`` a PEFT adapter (``adapter_config.json``). Full weights go through
``/update_weights_from_disk``; an adapter through SGLang's LoRA API: ``/load_lora_adapter`` under
the name :func:`adapter_name` (``policy-v<N>``), then the previous version's adapter is
unloaded and the client's :attr:`~areal_mega.rollout.client.RolloutClient.lora_name` names the
new one, so every later ``/generate`` (resubmitted interrupted requests included) uses it.
The caller pauses the servers around the load as for full weights; the per-token versions are
the controller's, so they stay exact across the swap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from areal_mega.rollout.generate_result import RolloutRequestError

__all__ = [
    "ADAPTER_CONFIG",
    "adapter_name",
    "is_adapter_dir",
    "load_published",
    "load_published_into",
]

ADAPTER_CONFIG = "adapter_config.json"


def adapter_name(version: int) -> str:
    """The adapter name of a published version on the servers."""
    return f"policy-v{int(version)}"


def is_adapter_dir(path) -> bool:
    """True for a PEFT adapter directory (a LoRA run's published version)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


async def load_published(client, path, version: Optional[int]) -> None:
    """Load the published directory ``path`` (version ``version``) on every live server of
    ``client``: full weights, or the adapter that then replaces the previous one."""
    if not is_adapter_dir(path):
        await client.update_weights_from_disk(str(path), version)
        return
    name = adapter_name(version or 0)
    old = client.lora_name
    if old != name:
        await client.load_lora_adapter(name, str(path))
        client.lora_name = name
        if old is not None:
            await client.unload_lora_adapter(old)
    if version is not None:
        await client.set_weight_version(version)


async def load_published_into(client, addr: str, path, version: int) -> None:
    """Load the published directory ``path`` into the one server ``addr`` (a server joining or
    coming back: it holds the base model). With an adapter, ``client.lora_name`` becomes its
    name."""
    timeout = client.control_timeout_s
    if not is_adapter_dir(path):
        await client.request(
            addr,
            "POST",
            "/update_weights_from_disk",
            {"model_path": str(path), "abort_all_requests": False, "weight_version": str(version)},
            timeout=timeout,
        )
        return
    name = adapter_name(version)
    try:
        loaded = (
            await client.request(
                addr,
                "POST",
                "/load_lora_adapter",
                {"lora_name": name, "lora_path": str(path)},
                timeout=timeout,
            )
        ).get("loaded_adapters") or {}
    except RolloutRequestError as e:  # a server that came back without a restart
        if "already" not in str(e).lower():
            raise
        loaded = {}
    for old in loaded:  # earlier versions it may still hold
        if old != name and old.startswith("policy-v"):
            await client.request(
                addr, "POST", "/unload_lora_adapter", {"lora_name": old}, timeout=timeout
            )
    await client.request(
        addr, "POST", "/update_weight_version", {"new_version": str(version)}, timeout=timeout
    )
    client.lora_name = name
