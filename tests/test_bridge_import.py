"""Megatron-Bridge one family at a time (areal_mega/compat/bridge_import.py): each family's
provider, read with its bridge module of ``FAMILY_MODULES`` alone, equals the provider the
whole bridge gives; that module is the one ``AutoBridge`` dispatches the family to (a release
that moves it fails here); the deferred package bodies run on demand, after which every family
is there; LoRA's PEFT layers import without the model families."""

import textwrap

import pytest

from areal_mega.compat.bridge_import import FAMILY_MODULES
from areal_mega.models.bridge_provider import (
    HYBRID_FAMILIES,
    PROVIDER_FAMILIES,
    VL_PROVIDER_FAMILIES,
)
from tests.helpers.workers import BARE_ENV, run_code

pytestmark = pytest.mark.timeout(600)

PROVIDERS = textwrap.dedent("""
    import dataclasses, json, re, sys
    from transformers import AutoConfig
    from areal_mega.compat import bridge_import
    from areal_mega.models import bridge_provider as bp

    whole = sys.argv[1] == "whole"
    if whole:
        bp._import_auto_bridge()  # every family, as before this module existed

    def plain(v):  # a field as text, without the memory addresses of its objects
        if callable(v) and hasattr(v, "__qualname__"):
            return f"{getattr(v, '__module__', '?')}.{v.__qualname__}"
        return re.sub(r" (at|object at) 0x[0-9a-f]+", "", repr(v))

    out = {"providers": {}, "modules": {}}
    for mt in bridge_import.FAMILY_MODULES:
        p = bp.provider_for(AutoConfig.for_model(mt).to_dict())
        out["providers"][mt] = [type(p).__name__] + sorted(
            f"{f.name}={plain(getattr(p, f.name, None))}" for f in dataclasses.fields(p)
        )
        ab = bp._import_auto_bridge(mt)
        cfg = bp.hf_config_object(AutoConfig.for_model(mt).to_dict())
        out["modules"][mt] = type(ab.from_hf_config(cfg)._model_bridge).__module__
    out["deferred"] = bridge_import.deferred()
    out["diffusion"] = "megatron.bridge.diffusion" in sys.modules
    out["bailing"] = "megatron.bridge.models.bailing" in sys.modules
    if not whole:
        bridge = bridge_import.import_whole_bridge()
        out["after_whole"] = {
            "deferred": bridge_import.deferred(),
            "auto_bridge": hasattr(bridge, "AutoBridge"),
            "bailing": "megatron.bridge.models.bailing" in sys.modules,
        }
    print(json.dumps(out))
""")


def _run(side):
    env = dict(BARE_ENV, AREAL_MEGA_CACHE_DIR="off", HOME="/nonexistent")
    return run_code(PROVIDERS, side, env=env, timeout=500)


@pytest.fixture(scope="module")
def sides():
    return {side: _run(side) for side in ("family", "whole")}


def test_every_provider_family_has_its_module():
    assert set(FAMILY_MODULES) == {*PROVIDER_FAMILIES, *VL_PROVIDER_FAMILIES, *HYBRID_FAMILIES}


def test_a_family_alone_gives_the_provider_of_the_whole_bridge(sides):
    family, whole = sides["family"], sides["whole"]
    assert family["providers"].keys() == whole["providers"].keys() == FAMILY_MODULES.keys()
    for mt in FAMILY_MODULES:
        assert family["providers"][mt] == whole["providers"][mt], mt
    # the families alone: the package bodies never ran, nor did the other families' imports
    assert family["deferred"] == ["megatron.bridge", "megatron.bridge.models"]
    assert not family["diffusion"] and not family["bailing"]
    assert whole["deferred"] == [] and whole["diffusion"] and whole["bailing"]


def test_each_module_is_where_the_bridge_dispatches_its_family(sides):
    for side in ("family", "whole"):
        assert sides[side]["modules"] == FAMILY_MODULES, side


def test_the_deferred_bodies_run_on_demand(sides):
    assert sides["family"]["after_whole"] == {"deferred": [], "auto_bridge": True, "bailing": True}


def test_lora_layers_import_without_the_model_families():
    code = textwrap.dedent("""
        import json, sys
        from areal_mega.lora.layers import import_canonical_lora
        lora, wrapper = import_canonical_lora()
        print(json.dumps({
            "classes": [lora.__name__, wrapper.__name__],
            "families": sorted(m for m in sys.modules if m.startswith("megatron.bridge.models.")
                               and m.count(".") == 3),
        }))
    """)
    out = run_code(code, env=BARE_ENV, timeout=300)
    assert out["classes"] == ["CanonicalLoRA", "AdapterWrapper"]
    assert out["families"] == [], out["families"]
