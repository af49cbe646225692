"""Which HF architectures our trainer engine and our CPU rollout server run, for a list of
architecture names (Megatron-Bridge's ``list_supported_models()`` in
``tools/list_bridge_models.py``).

Everything is read from the code that decides it, not written down here:

* engine: the architecture is a causal-LM class of a family in
  :data:`areal_mega.checkpoint.hf_mapping.FAMILIES` whose model type the builder accepts
  (:data:`areal_mega.models.builder.SUPPORTED_MODEL_TYPES`);
* CPU server: it loads ``AutoModelForCausalLM`` (no remote code), so it runs an architecture
  that the installed transformers maps as a causal LM of some model type; its running batch
  is :class:`~areal_mega.inference.kv_cache.StaticKVBatch` or transformers' cache
  (:class:`~areal_mega.inference.kv_cache.HFCacheBatch`) as
  :func:`~areal_mega.inference.kv_cache.kv_path_of` decides for that model type's default
  config; a vision-language model the trainer builds is loaded as its image-text-to-text class
  and served with images (:data:`SERVER_VL`, :mod:`areal_mega.inference.vision`);
* status: ``CPU end to end`` (an engine family: every one is checked end to end on the CPU by
  its family test), ``GPU only, not built yet`` (its layers need megatron-core kernels that
  exist for CUDA only: :data:`areal_mega.models.bridge_provider.GPU_ONLY`, which names why;
  the CPU refuses it and the engine does not build it yet) or ``not supported`` with the reason.

:func:`support_rows` is the pure part (plain data in and out).
"""

from __future__ import annotations

from typing import Iterable, Optional

from areal_mega.checkpoint.hf_mapping import FAMILIES
from areal_mega.inference.kv_cache import kv_path_of
from areal_mega.models.bridge_provider import (
    NOT_BUILT,
    VL_END_TO_END,
    VL_NOT_BUILT,
    VL_NOT_RL,
    VL_PROVIDER_FAMILIES,
    VL_RL_FAMILIES,
)
from areal_mega.models.builder import SUPPORTED_MODEL_TYPES

__all__ = [
    "engine_architectures",
    "causal_lm_model_types",
    "server_kv_paths",
    "support_rows",
    "vl_rl_architectures",
    "vl_trainer_architectures",
    "vl_not_built_architectures",
    "markdown_table",
    "SERVER_PATHS",
    "ENGINE_HF_CACHE",
    "SERVER_VL",
    "STATUS",
]

#: how the CPU server runs a model: :func:`kv_path_of`'s answer -> what the table says. Our
#: tests serve StaticKV families end to end; an HF-cache family is loaded and batched by the
#: generic path, which no test of ours runs on it (hence "not tested here")
SERVER_PATHS = {"static": "yes (StaticKV)", "hf_cache": "loads (HF cache, not tested here)"}
#: an engine family on the HF-cache path (Gemma 3): every engine family is served end to end
#: by its family test (tests/test_new_families.py), whichever running batch it gets
ENGINE_HF_CACHE = "yes (HF cache)"
#: a vision-language model RL runs end to end: the server loads its image-text-to-text class
#: and serves ``image_data`` (:mod:`areal_mega.inference.vision`; tests/test_vl_rollout.py)
SERVER_VL = "yes (HF cache, with images)"


#: the status column's three values
STATUS = {"cpu": "CPU end to end", "gpu": "GPU only, not built yet", "no": "not supported"}
#: why a causal LM that transformers runs and the bridge maps is not an engine family
NO_ENGINE_FAMILY = "no engine family yet"


def engine_architectures() -> dict:
    """``{architecture: model_type}`` of every causal LM the trainer engine builds."""
    return {
        a: mt
        for mt, fam in FAMILIES.items()
        if mt in SUPPORTED_MODEL_TYPES
        for a in fam.architectures
    }


def causal_lm_model_types() -> dict:
    """``{architecture: [model_type, ...]}`` of the installed transformers' causal-LM classes
    (what ``AutoModelForCausalLM`` loads)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out: dict = {}
    for model_type, arch in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        out.setdefault(arch, []).append(model_type)
    return out


def vl_trainer_architectures() -> dict:
    """``{architecture: why}`` of the vision-language models the trainer engine builds
    (:data:`~areal_mega.models.bridge_provider.VL_PROVIDER_FAMILIES`, by transformers'
    image-text-to-text class) but RL does not run yet, and why."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return {
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[mt]: VL_NOT_RL
        for mt in VL_PROVIDER_FAMILIES
        if mt not in VL_RL_FAMILIES
    }


def vl_not_built_architectures() -> dict:
    """``{architecture: why}`` of the vision-language models the engine does not build
    (:data:`~areal_mega.models.bridge_provider.VL_NOT_BUILT`, by transformers'
    image-text-to-text class; the reason is :data:`~areal_mega.models.bridge_provider.
    NOT_BUILT`'s)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return {MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[mt]: NOT_BUILT[mt] for mt in VL_NOT_BUILT}


def vl_rl_architectures() -> dict:
    """``{architecture: note}`` of the vision-language models RL runs end to end on the CPU
    (:data:`~areal_mega.models.bridge_provider.VL_RL_FAMILIES`, by transformers'
    image-text-to-text class)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return {MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[mt]: VL_END_TO_END for mt in VL_RL_FAMILIES}


def server_kv_paths(model_types: Iterable[str]) -> dict:
    """``{model_type: "static" | "hf_cache"}``: the server's running batch for each model
    type's default transformers config."""
    from transformers import AutoConfig

    return {mt: kv_path_of(AutoConfig.for_model(mt)) for mt in model_types}


def support_rows(
    architectures: Iterable[str],
    *,
    engine: dict,
    causal_lm: dict,
    kv_paths: dict,
    transformers_classes: Optional[set] = None,
    gpu_only: Optional[dict] = None,
    not_built: Optional[dict] = None,
    vl_trainer: Optional[dict] = None,
    vl_not_built: Optional[dict] = None,
    vl_rl: Optional[dict] = None,
) -> list:
    """One row per architecture (in the given order, duplicates dropped): ``architecture``,
    ``model_type`` (ours, else transformers' first; None when transformers has no causal-LM
    class of that name), ``engine`` (bool), ``server`` (a :data:`SERVER_PATHS` value,
    :data:`ENGINE_HF_CACHE`, :data:`SERVER_VL` for a ``vl_trainer`` / ``vl_rl`` architecture,
    or ``"no"``)
    and ``note`` (why the server does not run it). ``engine`` / ``causal_lm`` /
    ``kv_paths`` are :func:`engine_architectures`, :func:`causal_lm_model_types` and
    :func:`server_kv_paths`; ``transformers_classes``: names the installed transformers
    exports (tells "not a causal LM" from "not in transformers"); ``gpu_only``:
    ``{model_type: why}`` of the families needing GPU-only kernels; ``not_built``: ``{model_type:
    why}`` of the others the engine does not build; ``vl_trainer``: ``{architecture: why}`` of
    the vision-language models the trainer builds (served with images by the CPU server) but
    RL does not run end to end yet; ``vl_not_built``: ``{architecture: why}`` of those it
    does not build; ``vl_rl``: ``{architecture: note}`` of those RL runs end to end (served
    with images too). ``status`` is a :data:`STATUS` value and ``status_note`` its reason
    (GPU only / not supported) or, for a vision-language model RL runs, its note."""
    rows, seen = [], set()
    for arch in architectures:
        if arch in seen:
            continue
        seen.add(arch)
        types = causal_lm.get(arch) or []
        model_type = engine.get(arch) or (types[0] if types else None)
        if arch in (vl_rl or {}):
            server, note = SERVER_VL, ""
        elif arch in (vl_trainer or {}):  # loaded with images, no RL test serves it
            server, note = SERVER_PATHS["hf_cache"], ""
        elif model_type is not None and model_type in types:
            path = kv_paths[model_type]
            server = (
                ENGINE_HF_CACHE if arch in engine and path == "hf_cache" else SERVER_PATHS[path]
            )
            note = ""
        elif transformers_classes is not None and arch not in transformers_classes:
            server, note = "no", "not in transformers (remote code)"
        else:
            server, note = "no", "not a causal LM for AutoModelForCausalLM"
        if arch in engine:
            status, why = STATUS["cpu"], ""
        elif arch in (vl_rl or {}):
            status, why = STATUS["cpu"], vl_rl[arch]
        elif model_type is not None and (gpu_only or {}).get(model_type):
            status, why = STATUS["gpu"], gpu_only[model_type]
        elif arch in (vl_trainer or {}):
            status, why = STATUS["no"], vl_trainer[arch]
        elif arch in (vl_not_built or {}):
            status, why = STATUS["no"], vl_not_built[arch]
        else:
            status = STATUS["no"]
            why = note or (not_built or {}).get(model_type) or NO_ENGINE_FAMILY
        rows.append(
            {
                "architecture": arch,
                "model_type": model_type,
                "engine": arch in engine or arch in (vl_rl or {}),
                "server": server,
                "note": note,
                "status": status,
                "status_note": why,
            }
        )
    return rows


def markdown_table(rows: list) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| Architecture (Megatron-Bridge) | model_type | our engine | our CPU server | status |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        server = r["server"] + (f": {r['note']}" if r["note"] else "")
        status = r.get("status", "") + (f" ({r['status_note']})" if r.get("status_note") else "")
        lines.append(
            f"| `{r['architecture']}` | {r['model_type'] or '-'} | "
            f"{'yes' if r['engine'] else 'no'} | {server} | {status} |"
        )
    return "\n".join(lines)
