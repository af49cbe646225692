"""Megatron-Bridge imported one model family at a time.

``import megatron.bridge.<anything>`` first runs ``megatron/bridge/__init__.py``, and that runs
``megatron/bridge/models/__init__.py``: together they import every family's provider and
bridge, the diffusion models and ``megatron.training``, so that ``AutoBridge`` finds any
architecture. That is ~7 s of CPU on a 2-core AMD EPYC with AVX-512 (2026-12-02), about 2.5x
that on slower CPUs, in every process that reads a provider (a config not in the provider
cache, a vision-language or hybrid model), builds LoRA adapters or Qwen3-VL's layers, while
such a process needs one family.

:func:`import_bridge_modules` imports the modules it is given with those two package modules
created but their bodies deferred: ``sys.modules`` holds them as packages, so their
submodules import as usual, and a family's bridge module registers its architecture with
``AutoBridge`` when it is imported, as the package body would have imported it.
:func:`import_whole_bridge` runs the deferred bodies (or imports the bridge whole) for code that
needs every family (``tools/sync_bridge_tables.py``, a family outside
:data:`FAMILY_MODULES`). ``tests/test_bridge_import.py``
checks that each family's provider is the same either way, and notices when a release moves a
family's module.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

#: the Megatron-Bridge module that registers each family's bridge with ``AutoBridge`` (the
#: provider families of :mod:`areal_mega.models.bridge_provider`); ``tests/test_bridge_import.py``
#: notices when a release moves one
FAMILY_MODULES = {
    "llama": "megatron.bridge.models.llama.llama_bridge",
    "qwen2": "megatron.bridge.models.qwen.qwen2_bridge",
    "qwen3": "megatron.bridge.models.qwen.qwen3_bridge",
    "qwen3_moe": "megatron.bridge.models.qwen.qwen3_moe_bridge",
    "mistral": "megatron.bridge.models.mistral.mistral_bridge",
    "glm4_moe": "megatron.bridge.models.glm.glm45_bridge",
    "deepseek_v3": "megatron.bridge.models.deepseek.deepseek_v3_bridge",
    "deepseek_v2": "megatron.bridge.models.deepseek.deepseek_v2_bridge",
    "gemma": "megatron.bridge.models.gemma.gemma_bridge",
    "glm4_moe_lite": "megatron.bridge.models.glm.glm47_flash_bridge",
    "glm_moe_dsa": "megatron.bridge.models.glm_moe_dsa.glm5_bridge",
    "hy_v3": "megatron.bridge.models.hy_v3.hy_v3_bridge",
    "nemotron": "megatron.bridge.models.nemotron.nemotron_bridge",
    "olmoe": "megatron.bridge.models.olmoe.olmoe_bridge",
    "minimax_m2": "megatron.bridge.models.minimax_m2.minimax_m2_bridge",
    "gpt_oss": "megatron.bridge.models.gpt_oss.gpt_oss_bridge",
    "ernie4_5_moe": "megatron.bridge.models.ernie.ernie_45_bridge",
    "exaone_moe": "megatron.bridge.models.exaone.exaone_moe.exaone_moe_bridge",
    "exaone4": "megatron.bridge.models.exaone.exaone4.exaone4_bridge",
    "qwen3_next": "megatron.bridge.models.qwen.qwen3_next_bridge",
    "qwen3_5_text": "megatron.bridge.models.qwen.qwen35_bridge",
    "qwen3_5_moe_text": "megatron.bridge.models.qwen.qwen35_bridge",
    "qwen2_5_vl": "megatron.bridge.models.qwen_vl.qwen25_vl_bridge",
    "qwen3_vl": "megatron.bridge.models.qwen_vl.qwen3_vl_bridge",
    "nemotron_h": "megatron.bridge.models.nemotronh.nemotron_h_bridge",
    "falcon_h1": "megatron.bridge.models.falcon_h1.falconh1_bridge",
}

#: the package modules whose bodies import the whole bridge, outermost first
DEFERRED_PACKAGES = ("megatron.bridge", "megatron.bridge.models")

_PENDING: dict = {}  # name -> spec of a package module whose body has not run


def _defer_package_bodies() -> None:
    """Creates the :data:`DEFERRED_PACKAGES` not imported yet, without running their
    bodies."""
    for name in DEFERRED_PACKAGES:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        setattr(sys.modules[parent], child, module)
        _PENDING[name] = spec


def deferred() -> list:
    """The package modules whose bodies this process has deferred and not run yet."""
    return [name for name in DEFERRED_PACKAGES if name in _PENDING]


def import_bridge_modules(*names: str) -> list:
    """The Megatron-Bridge modules ``names``, imported without the package bodies that import
    every family (see the module docstring); where the bridge is already imported whole, as
    usual. Install the TransformerEngine placeholder first where TE is absent."""
    _defer_package_bodies()
    return [importlib.import_module(name) for name in names]


def import_whole_bridge():
    """``megatron.bridge`` with every family imported: the deferred package bodies run now,
    innermost first (the outer one imports the inner)."""
    for name in reversed(DEFERRED_PACKAGES):
        spec = _PENDING.pop(name, None)
        if spec is not None:
            spec.loader.exec_module(sys.modules[name])
    return importlib.import_module("megatron.bridge")
