"""HF ↔ megatron tensor tables taken from Megatron-Bridge's own mapping registries.

Megatron-Bridge describes each HF architecture it converts as a ``MegatronMappingRegistry``:
megatron parameter name patterns (``decoder.layers.*.self_attention.linear_qkv.weight``) mapped
to HF name patterns, with a mapping class that says how the tensors combine (``AutoMapping``:
one tensor as it is; ``QKVMapping``: q, k, v interleaved per KV group; ``GatedMLPMapping``:
gate and up stacked). Its converters apply them to a materialised, process-group-sharded
model. Ours stream one tensor at a time between safetensors and a distributed checkpoint of
any layout (:mod:`areal_mega.checkpoint.convert`) and feed the live weight export, so this
module takes the bridge's *tables*, not its converter:

* :func:`bridge_rows` reads the registry of the installed bridge for one architecture as plain
  rows ``{"megatron", "hf", "kind"}``;
* :func:`table_from_rows` (pure) turns them into our table form: local-spec names (the
  registry also lists TransformerEngine's fused names, e.g. ``linear_qkv.layer_norm_weight``,
  which :mod:`~areal_mega.checkpoint.hf_mapping` canonicalises to the local ones, and
  grouped-GEMM ``experts.linear_fc1.weight*``, which become ``local_experts.{E}`` names;
  some registries list only those), ``{L}``/``{E}`` for the layer/expert wildcards, and the
  kinds ``copy``, ``qkv``, ``glu``, ``vocab`` (embedding and output layer, padded rows) and
  ``row`` (an HF tensor of one row, ``[1, n]``, that is megatron's ``[n]``);
* the tables of the families we convert are kept in ``bridge_tables.json`` beside this module,
  written by ``python tools/sync_bridge_tables.py`` from the pinned bridge, because importing
  Megatron-Bridge takes about 10 s (it imports every model provider) and every trainer,
  converter and rollout worker reads the tables; ``tests/test_bridge_tables.py`` fails when
  the file and the installed bridge disagree.

The tensor transforms themselves (:func:`~areal_mega.checkpoint.hf_mapping.qkv_to_mcore` and
friends) stream and reshard; the same test checks the QKV one bit for bit against the bridge's
``merge_qkv_weights`` / ``split_qkv_weights`` (its gated MLP, like ours, stacks ``[gate; up]``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional

from areal_mega.compat.bridge_import import import_whole_bridge

__all__ = [
    "BRIDGED_ARCHITECTURES",
    "VL_BRIDGED_ARCHITECTURES",
    "VL_VISION_PREFIX",
    "SNAPSHOT",
    "UnsupportedMappingError",
    "FUSED_EXPERT_KINDS",
    "bridge_rows",
    "table_from_rows",
    "vl_table_from_rows",
    "derive_tables",
    "load_tables",
    "import_bridge",
]

#: model_type -> the HF architecture whose bridge registry gives its table
BRIDGED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
    "hy_v3": "HYV3ForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "minimax_m2": "MiniMaxM2ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "exaone_moe": "ExaoneMoeForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "glm_moe_dsa": "GlmMoeDsaForCausalLM",
}
#: vision-language model_type -> the HF architecture whose bridge registry gives its table
#: (:func:`vl_table_from_rows`; the model is :mod:`areal_mega.models.vlm`'s)
VL_BRIDGED_ARCHITECTURES = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}
#: the vision tower's module in the megatron names of the vision-language families whose tower
#: is built from megatron-core layers (per-tensor rows, :func:`vl_table_from_rows`)
VL_VISION_PREFIX = {"qwen3_vl": "vision_model."}
#: the language model's module in a vision-language model's megatron names
VL_LANGUAGE_PREFIX = "language_model."
SNAPSHOT = Path(__file__).with_name("bridge_tables.json")

_KINDS = {
    "AutoMapping": "copy",
    "QKVMapping": "qkv",
    "GatedMLPMapping": "glu",
    # MiniMax-M2's whole-projection QK norm weight: one tensor as it is (its TP slices are the
    # megatron module's own sharding, areal_mega/models/olmoe.py)
    "_FullDimQKNormMapping": "copy",
    # GPT-OSS: each layer's experts in one HF tensor ([E, ...]); per expert its slice,
    # transposed (weights) and, for gate / up, de-interleaved (gate on even, up on odd units)
    "GPTOSSMLPGateUpProjMapping": "fused_expert_glu",
    "GPTOSSMLPDownProjMapping": "fused_expert",
    # Ernie 4.5: the router weight is replicated (one tensor as it is); the bridge's variants
    # that skip a dense layer's absent MoE tensors in its pipeline export (ours map dense and
    # MoE layers apart); the expert bias, [1, experts] in HF and [experts] in megatron
    "ReplicatedMapping": "copy",
    "_PPSafeAutoMapping": "copy",
    "_PPSafeReplicatedMapping": "copy",
    "_PPSafeGatedMLPMapping": "glu",
    "_SqueezeBiasMapping": "row",
    # Qwen3-Next's gated delta-net (areal_mega/checkpoint/hf_mapping_gdn.py): the input
    # projection regrouped from per key head to per section; the convolution's channels are
    # [q; k; v] on both sides; the output norm's gain w is megatron's zero-centred w - 1
    "GDNLinearMapping": "gdn_in_proj",
    # Qwen3.5: the same input projection in four tensors ([q; k; v], z, b, a), each flat
    "GDNLinearMappingSeparate": "gdn_in_proj_split",
    "GDNConv1dMapping": "copy",
    "RMSNorm2ZeroCenteredRMSNormMapping": "minus_one",
    # Nemotron-H's and Falcon-H1's Mamba mixers: whole tensors as they are; their
    # tensor-parallel shards (column / row parallel, in_proj and conv1d section by section) are
    # the megatron module's own sharding, which the distributed checkpoint and the weight
    # export follow
    "ColumnParallelMapping": "copy",
    "RowParallelMapping": "copy",
    "MambaInProjMapping": "copy",
    "MambaConv1dMapping": "copy",
    # Qwen3-VL's vision attention: q, k and v stacked in one HF tensor ([q; k; v]); megatron's
    # fused QKV groups them per head
    "ConcatenatedQKVMapping": "qkv_concat",
    # Gemma 4's QKV, which tolerates the absent k / v projections of the key/value-shared
    # layers and v of the K = V layers (our rows per layer: areal_mega/checkpoint/hf_mapping.py)
    "_Gemma4DenseQKVMapping": "qkv",
}
#: kinds whose HF tensor holds every expert of the layer: the template addresses expert E's
#: slice as ``name[E]`` (:func:`areal_mega.checkpoint.safetensors_io.split_row_name`);
#: ``fused_expert_rows`` (Gemma 4's MoE, rows of areal_mega/checkpoint/hf_mapping_gemma4.py):
#: each slice as it is
FUSED_EXPERT_KINDS = ("fused_expert", "fused_expert_glu", "fused_expert_rows")
_HF_PARTS = {
    "qkv": ("q", "k", "v"),
    "glu": ("gate", "up"),
    "gdn_in_proj": ("qkvz", "ba"),
    "gdn_in_proj_split": ("qkv", "z", "b", "a"),
}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
_LAYER = "decoder.layers.*."
#: TransformerEngine's norms fused into the next linear (``LayerNormLinear``), e.g.
#: ``self_attention.linear_qkv.layer_norm_weight``: the local spec has a separate norm module,
#: which the registry lists beside each
_TE_FUSED_NORM = (".layer_norm_weight", ".layer_norm_bias")
#: the local-spec norm of a fused TE name, for registries that list only the fused name
#: (Gemma 3's input and pre-feedforward norms; Nemotron's LayerNorm weights and biases)
_TE_FUSED_LOCAL = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "pre_mlp_layernorm.bias",
}
#: TE grouped-GEMM expert weights (``mlp.experts.linear_fc1.weight*``): the local spec's
#: ``local_experts.<E>.linear_fc1.weight`` (some registries list only these)
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)\*$")
#: modules the engine's builder never creates (multi-token-prediction layers)
_NOT_BUILT = ("mtp.",)


class UnsupportedMappingError(ValueError):
    """A bridge mapping this table form cannot express (the message names it)."""


def import_bridge():
    """Import Megatron-Bridge (through the checked TransformerEngine placeholder where TE is
    absent) and return its ``get_model_bridge`` and ``AutoBridge``."""
    from areal_mega.compat.megatron_cpu import install_te_placeholder

    install_te_placeholder()
    import_whole_bridge()  # every family's registry (this process may have deferred them)
    from megatron.bridge.models.conversion.auto_bridge import AutoBridge
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    return get_model_bridge, AutoBridge


def bridge_rows(architecture: str) -> List[dict]:
    """The installed bridge's registry for ``architecture`` (an HF class name, e.g.
    ``"LlamaForCausalLM"``) as rows ``{"megatron": pattern, "hf": [patterns], "kind": k}``."""
    import transformers

    get_model_bridge, _ = import_bridge()
    model_class = getattr(transformers, architecture)
    # Some registries read the HF config (layer counts for multi-token-prediction rows): the
    # family's default config. Registries that look at a checkpoint's tensor names (fused or
    # per-expert MoE weights) find none in a config, so they describe the per-expert layout
    # that transformers' save_pretrained writes and our converters read.
    bridge = get_model_bridge(model_class, hf_config=model_class.config_class())
    rows = []
    for m in bridge.mapping_registry().mappings:
        kind = _KINDS.get(type(m).__name__)
        if kind is None:
            raise UnsupportedMappingError(
                f"{architecture}: {type(m).__name__} for {m.megatron_param!r} has no table form"
            )
        if kind in FUSED_EXPERT_KINDS:
            hf = [m.hf_param + "[*]"]
        else:
            hf = [m.hf_param[p] for p in _HF_PARTS[kind]] if kind in _HF_PARTS else [m.hf_param]
        rows.append({"megatron": m.megatron_param, "hf": hf, "kind": kind})
    return rows


def _templates(hf: List[str]) -> List[str]:
    """HF patterns with the first ``*`` as ``{L}`` (layer) and the second as ``{E}``."""
    out = []
    for h in hf:
        h = h.replace("*", "{L}", 1).replace("*", "{E}", 1)
        if "*" in h:
            raise UnsupportedMappingError(f"HF pattern {h!r} has more than two wildcards")
        out.append(h)
    return out


def table_from_rows(rows: List[dict]) -> Dict[str, List[dict]]:
    """Pure: bridge rows -> ``{"global": [...], "layer": [...]}`` of ``{"mcore", "hf", "kind"}``
    in our form (local-spec names within a layer, ``{L}``/``{E}`` templates; TE-only names and
    modules the builder never creates dropped, grouped-GEMM expert names made local; a fused
    TE norm name becomes the local norm's name where the registry lists no local row for it;
    duplicates dropped, first kept)."""
    table: Dict[str, List[dict]] = {"global": [], "layer": []}
    seen = set()
    listed = {r["megatron"] for r in rows}
    for row in rows:
        name, kind = row["megatron"], row["kind"]
        if name.startswith(_NOT_BUILT):
            continue
        if name.startswith(_LAYER):
            suffix = name[len(_LAYER) :]
            if suffix.endswith(_TE_FUSED_NORM):
                local = _TE_FUSED_LOCAL.get(suffix)
                if local is None or _LAYER + local in listed:
                    continue
                suffix = local
            grouped = _GROUPED_EXPERT.match(suffix)
            if grouped:  # TE grouped GEMM: one weight<E> per expert of the layer
                suffix = f"mlp.experts.local_experts.*.{grouped.group(1)}.{grouped.group(2)}"
            if "*" in suffix:
                if not suffix.startswith("mlp.experts.local_experts.*."):
                    raise UnsupportedMappingError(
                        f"megatron pattern {name!r}: a wildcard "
                        "other than the layer and local expert"
                    )
                suffix = suffix.replace("*", "{E}", 1)
            scope, entry = "layer", {"mcore": suffix}
        elif "*" in name:
            raise UnsupportedMappingError(f"megatron pattern {name!r} outside decoder.layers")
        else:
            scope, entry = "global", {"mcore": name}
            if name in _VOCAB:
                kind = "vocab"
        if (scope, entry["mcore"]) in seen:
            continue
        seen.add((scope, entry["mcore"]))
        entry.update(hf=_templates(row["hf"]), kind=kind)
        table[scope].append(entry)
    return table


def vl_table_from_rows(rows: List[dict], vision_prefix: Optional[str] = None) -> dict:
    """Pure: a vision-language registry's rows -> ``{"language": table, "subtrees": [...]}``:
    the language model's rows (``language_model.`` names) in :func:`table_from_rows`' form,
    names relative to the language model; a whole-module row (``visual.**`` <-> ``visual.**``,
    every tensor of the module under the same relative name, unchanged) as a subtree
    ``{"mcore": "visual.", "hf": "visual."}``. With ``vision_prefix`` (a tower of megatron-core
    layers, :data:`VL_VISION_PREFIX`), the rows under it go to ``"vision"`` as patterns
    ``{"mcore", "hf", "kind"}`` (``*``: an index, ``**``: the rest of the name, filled into the
    HF patterns in order; TransformerEngine's fused norm names made the local norms'; kinds
    ``copy`` and ``qkv_concat``). Any other row is refused."""
    language, subtrees, vision, seen = [], [], [], set()
    for row in rows:
        name, hf = row["megatron"], row["hf"]
        if name.startswith(VL_LANGUAGE_PREFIX):
            language.append(dict(row, megatron=name[len(VL_LANGUAGE_PREFIX) :]))
        elif vision_prefix and name.startswith(vision_prefix):
            if row["kind"] not in ("copy", "qkv_concat") or len(hf) != 1:
                raise UnsupportedMappingError(
                    f"megatron pattern {name!r}: a vision row of kind {row['kind']!r}"
                )
            for fused, local in _TE_FUSED_LOCAL.items():
                if name.endswith("." + fused):
                    name = name[: -len(fused)] + local
            if name not in seen:
                seen.add(name)
                vision.append({"mcore": name, "hf": list(hf), "kind": row["kind"]})
        elif (
            name.endswith(".**")
            and len(hf) == 1
            and hf[0].endswith(".**")
            and row["kind"] == "copy"
            and "*" not in name[:-3] + hf[0][:-3]
        ):
            subtrees.append({"mcore": name[:-2], "hf": hf[0][:-2]})
        else:
            raise UnsupportedMappingError(
                f"megatron pattern {name!r}: neither the language model's nor a whole module"
            )
    out = {"language": table_from_rows(language), "subtrees": subtrees}
    if vision_prefix:
        out["vision"] = vision
    return out


def derive_tables() -> dict:
    """Every bridged family's table from the installed bridge, with its version."""
    from importlib.metadata import version

    return {
        "megatron_bridge": version("megatron-bridge"),
        "families": {
            mt: dict(architecture=arch, **table_from_rows(bridge_rows(arch)))
            for mt, arch in BRIDGED_ARCHITECTURES.items()
        },
        "vl_families": {
            mt: dict(
                architecture=arch,
                **vl_table_from_rows(bridge_rows(arch), VL_VISION_PREFIX.get(mt)),
            )
            for mt, arch in VL_BRIDGED_ARCHITECTURES.items()
        },
    }


def load_tables() -> dict:
    """The stored tables (``bridge_tables.json``): ``{"megatron_bridge": version,
    "families": {model_type: {"architecture", "global", "layer"}}, "vl_families":
    {model_type: {"architecture", "language": {"global", "layer"}, "subtrees"}}}``."""
    return json.loads(SNAPSHOT.read_text())
