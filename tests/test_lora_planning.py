"""The pure parts of the server's LoRA support: SGLang's flag rules, the adapter registry
(names, LRU eviction, pinning) and the admission planner of --max-loras-per-batch."""

import json
from collections import deque
from types import SimpleNamespace

import pytest

from areal_mega.inference.lora_adapters import (
    LoraAdapter,
    LoraRegistry,
    LoraSettings,
    lora_settings,
    parse_lora_path_item,
    stacked_names,
)
from areal_mega.inference.lora_layers import take_admissible


def test_lora_paths_items_take_sglangs_three_forms():
    assert parse_lora_path_item("v1=/a/b") == {
        "lora_name": "v1",
        "lora_path": "/a/b",
        "pinned": False,
    }
    assert parse_lora_path_item("/a/b") == {
        "lora_name": "/a/b",
        "lora_path": "/a/b",
        "pinned": False,
    }
    item = json.dumps({"lora_name": "p", "lora_path": "/x", "pinned": True})
    assert parse_lora_path_item(item) == {"lora_name": "p", "lora_path": "/x", "pinned": True}
    assert parse_lora_path_item("n=/p=q")["lora_path"] == "/p=q"  # split at the first '='
    for bad in ("=/x", "n=", '{"lora_name": "p"}'):
        with pytest.raises(ValueError):
            parse_lora_path_item(bad)


def test_settings_follow_check_lora_server_args():
    assert lora_settings(False, None, None, None).enabled is False
    s = lora_settings(True, 8, ["all"], None, 4, 6)
    assert s.enabled and s.max_rank == 8 and len(s.targets) == 7 and s.max_loaded == 6
    with pytest.raises(ValueError, match="--max-lora-rank and --lora-target-modules"):
        lora_settings(True, 8, None, None)
    with pytest.raises(ValueError, match="'all' must be the only"):
        lora_settings(True, 8, ["all", "q_proj"], None)
    with pytest.raises(ValueError, match="not supported"):
        lora_settings(True, 8, ["embed_tokens"], None)
    with pytest.raises(ValueError, match="must be >= --max-loras-per-batch"):
        lora_settings(True, 8, ["q_proj"], None, 4, 3)
    with pytest.raises(ValueError, match="must be positive"):
        lora_settings(True, 8, ["q_proj"], None, 0)


def test_settings_infer_rank_and_targets_from_preloaded_adapters(tmp_path):
    for name, r, targets in (("x", 4, ["q_proj", "v_proj"]), ("y", 8, ["down_proj"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(
            json.dumps({"r": r, "lora_alpha": 8, "target_modules": targets})
        )
    s = lora_settings(False, None, None, [f"x={tmp_path / 'x'}", str(tmp_path / "y")])
    assert s.enabled and s.max_rank == 8
    assert s.targets == ("q_proj", "v_proj", "down_proj")
    assert [p["lora_name"] for p in s.preload] == ["x", str(tmp_path / "y")]
    with pytest.raises(ValueError, match="exceed --max-loaded-loras=1"):
        lora_settings(False, None, None, [f"x={tmp_path / 'x'}", f"z={tmp_path / 'y'}"], 1, 1)


def test_stacked_names_group_like_sglang():
    assert stacked_names(["q_proj", "k_proj"]) == {"qkv_proj"}
    assert stacked_names(["up_proj", "o_proj"]) == {"gate_up_proj", "o_proj"}


def adapter(name, pinned=False):
    return LoraAdapter(name, f"/{name}", 2, 1.0, frozenset(), {}, pinned)


def test_registry_names_lru_eviction_and_pinning():
    reg = LoraRegistry(LoraSettings(True, 8, ("q_proj",), max_per_batch=3, max_loaded=3), {})
    for n in ("a", "b", "c"):
        assert reg.add(adapter(n)) == []
    with pytest.raises(ValueError, match="a because it is already loaded"):
        reg.add(adapter("a"))
    assert reg.lookup(["a", None])[1] is None  # a is now the most recently used
    gone = reg.add(adapter("d"))
    assert [g.name for g in gone] == ["b"] and list(reg.loaded) == ["c", "a", "d"]
    assert reg.to_reload(["b", "b", "a", None]) == [("b", "/b", False)]
    with pytest.raises(ValueError, match="not loaded: b"):
        reg.lookup(["b"])
    with pytest.raises(ValueError, match="4 unique loras requested"):
        reg.lookup(["a", "c", "d", None])
    assert reg.remove("c").name == "c" and "c" not in reg.loaded
    with pytest.raises(ValueError, match="LoRA with name c does not exist"):
        reg.remove("c")
    reg.add(adapter("p", pinned=True))
    assert [g.name for g in reg.add(adapter("q", pinned=True))] == ["a"]  # LRU unpinned
    assert list(reg.loaded) == ["d", "p", "q"]
    with pytest.raises(ValueError, match="as a pinned adapter"):
        reg.check_load("r", pinned=True)  # 2 pinned of 3 slots: refused


def test_registry_cannot_evict_pinned_adapters():
    reg = LoraRegistry(LoraSettings(True, 8, ("q_proj",), max_per_batch=3, max_loaded=3), {})
    reg.add(adapter("p", pinned=True))
    reg.settings.max_loaded = 1
    with pytest.raises(ValueError, match="Didn't find any LoRA adapters"):
        reg.add(adapter("x"))
    assert list(reg.loaded) == ["p"]  # the failed load is not kept


def test_registry_refuses_everything_when_lora_is_off():
    reg = LoraRegistry(LoraSettings(), {})
    for call in (
        lambda: reg.check_load("a", False),
        lambda: reg.remove("a"),
        lambda: reg.lookup(["a"]),
    ):
        with pytest.raises(ValueError, match="Please set `--enable-lora`"):
            call()
    assert reg.lookup([None, None]) == [None, None]


def test_admission_keeps_distinct_adapters_per_batch_within_the_limit():
    a, b, c = object(), object(), object()
    req = lambda lora, tag: SimpleNamespace(lora=lora, tag=tag)  # noqa: E731
    running = [req(a, "r0")]
    waiting = deque([req(b, 1), req(c, 2), req(None, 3), req(b, 4), req(a, 5)])
    got = take_admissible(waiting, 10, running, 2)  # {a} running: room for one more
    assert [r.tag for r in got] == [1, 4, 5] and [r.tag for r in waiting] == [2, 3]
    waiting = deque([req(None, 1), req(None, 2), req(c, 3)])
    assert [r.tag for r in take_admissible(waiting, 1, [], 2)] == [1]  # room counts
    assert [r.tag for r in waiting] == [2, 3]
    waiting = deque([req(c, 1), req(a, 2)])
    assert [r.tag for r in take_admissible(waiting, 5, [], None)] == [1, 2]
    assert take_admissible(deque(), 5, running, 1) == []


def test_lora_layers_hook_only_batches_with_adapter_rows():
    """Per-row deltas: the adapter's rows get ``W x + s B A x``, the others ``W x``; a batch
    without adapter rows runs with no hook installed."""
    import torch

    from areal_mega.inference.cpu_linear import fused_linear
    from areal_mega.inference.lora_layers import LoraLayers

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.q_proj, model.k_proj = torch.nn.Linear(6, 4), torch.nn.Linear(6, 3)
    layers = LoraLayers(model, ("q_proj",))
    assert list(layers.modules) == ["q_proj"]
    a, b = torch.randn(2, 6), torch.randn(4, 2)
    ad = LoraAdapter("x", "/x", 2, 0.5, frozenset({"q_proj"}), {"q_proj": (a, b)})
    x = torch.randn(3, 5, 6)
    with torch.no_grad():
        plain_q, plain_k = model.q_proj(x), model.k_proj(x)
        layers.set_rows([None, ad, None])
        fused = fused_linear(x, (model.q_proj, model.k_proj))
        layers.set_rows([None, None, None])
        assert not model.q_proj._forward_hooks
        assert torch.equal(model.q_proj(x), plain_q)
    want = plain_q.clone()
    want[1] += 0.5 * (x[1] @ a.T) @ b.T
    torch.testing.assert_close(fused[..., :4], want)
    torch.testing.assert_close(fused[..., 4:], plain_k)


def test_prefix_cache_namespaces_share_the_budget(tmp_path):
    """One namespace per adapter load: a request matches only its own; writing one namespace
    past the shared budget drops the least recently used other, unless it is planned in the
    current round."""
    import torch

    from areal_mega.inference.kv_cache import StaticKVBatch
    from areal_mega.inference.prefix_reuse import PrefixReuse
    from areal_mega.models.tiny import make_tiny_model
    from tests.helpers.rollout import load_model

    batch = StaticKVBatch(
        load_model(
            make_tiny_model(tmp_path / "m", arch="llama", hidden_size=64, num_layers=2, seed=0)
        )
    )
    tokens = list(range(3, 23))
    with torch.no_grad():
        kv = batch.prefill(torch.tensor([tokens]))[1]
    req = lambda lora: SimpleNamespace(input_ids=tokens, lora=lora, prefix_limit=None)  # noqa
    base, x = req(None), req(SimpleNamespace(uid="x"))
    probe = PrefixReuse(batch, 64, False)
    probe.add_prefilled(base, kv, 0, None)
    one = probe.stats()["used_mb"]
    cache = PrefixReuse(batch, one * 1.5, False)  # room for one namespace's prompt
    cache.add_prefilled(base, kv, 0, None)
    assert cache.plan([x]) == ([(x, 0)], [])  # the base's keys are not x's
    cache.add_prefilled(x, kv, 0, None)  # drops the base namespace
    s = cache.stats()
    assert s["namespaces"] == 1 and s["evicted_tokens"] == 20 and s["used_mb"] == one
    assert cache.plan([base]) == ([(base, 0)], [])
    assert cache.plan([x]) == ([(x, 19)], [])  # x planned in this round ...
    cache.add_prefilled(base, kv, 0, None)  # ... so it is kept over budget
    assert cache.stats()["namespaces"] == 2
    assert [t.num_tokens for t in cache.trees.values()] == [20, 20]


def test_loaded_adapters_are_capped_by_default():
    """Without ``--max-loaded-loras`` a client cannot make the server hold adapters without
    bound: the cap is DEFAULT_MAX_LOADED_LORAS (at least --max-loras-per-batch)."""
    from areal_mega.inference.lora_adapters import DEFAULT_MAX_LOADED_LORAS

    assert lora_settings(True, 8, ["q_proj"], None).max_loaded == DEFAULT_MAX_LOADED_LORAS
    assert lora_settings(True, 8, ["q_proj"], None, 100).max_loaded == 100
    reg = LoraRegistry(lora_settings(True, 8, ["q_proj"], None, 2), {})
    for i in range(DEFAULT_MAX_LOADED_LORAS + 5):
        reg.add(LoraAdapter(f"n{i}", f"/p{i}", 8, 1.0, frozenset({"q_proj"}), {}))
    assert len(reg.loaded) == DEFAULT_MAX_LOADED_LORAS and "n0" in reg.evicted
