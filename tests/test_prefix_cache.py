"""The CPU rollout server's prefix cache: the radix tree (match, split, limit, LRU eviction under
its budget), a prefill continuing a cached prefix gives the logits of a full prefill (2e-5),
the engine with the cache answers what it answers without (tokens, logprobs, MoE routes) while
forwarding fewer prompt tokens, in-batch sharing and SGLang's ``cached_tokens``, a flush refused
while requests wait, and no reuse of keys/values across a weight update."""

import threading
import time

import numpy as np
import pytest
import torch

from areal_mega.inference.decoding import BatchedEngine, GenRequest
from areal_mega.inference.kv_cache import StaticKVBatch
from areal_mega.inference.prefix_cache import PrefixTree, common_prefix_len, concat_pieces
from areal_mega.inference.prefix_reuse import IN_BATCH_THRESHOLD
from areal_mega.inference.sampling import SamplingParams
from areal_mega.models.tiny import make_tiny_model
from tests.helpers.rollout import load_model

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------ the tree (plain data)
def _payload(tokens, start, end):
    """Payload whose entry 0 holds the token ids themselves (token dim 0), entry 1 twice them
    along dim 1."""
    t = torch.tensor(tokens[start:end], dtype=torch.float32)
    return t, torch.stack([t, t]) * 2


def _joined(tree, tokens, limit=None):
    n, pieces = tree.match(tokens, limit)
    got = concat_pieces(pieces, tree.token_dims)
    return n, None if got is None else got[0].tolist()


def test_tree_match_insert_split_and_limit():
    tree = PrefixTree(1 << 20, token_dims=(0, 1))
    a = [1, 2, 3, 4, 5]
    assert tree.match(a) == (0, [])
    assert tree.insert(a, lambda s, e: _payload(a, s, e)) == 5
    assert _joined(tree, a) == (5, [1, 2, 3, 4, 5])
    assert _joined(tree, a, limit=4) == (4, [1, 2, 3, 4])  # all but the last
    assert _joined(tree, [1, 2, 9]) == (2, [1, 2])  # inside a node
    b = [1, 2, 3, 7, 8, 9]
    assert tree.insert(b, lambda s, e: _payload(b, s, e)) == 3  # only the new tail is stored
    assert tree.num_tokens == 8
    assert _joined(tree, a) == (5, [1, 2, 3, 4, 5])  # after the split
    assert _joined(tree, b + [10]) == (6, b)
    n, pieces = tree.match(b)
    assert concat_pieces(pieces, tree.token_dims)[1].tolist() == [[2.0 * t for t in b]] * 2
    assert tree.insert(a[:3], lambda s, e: _payload(a, s, e)) == 0  # a cached prefix
    assert tree.match([7, 1, 2]) == (0, [])
    assert tree.nbytes == 8 * 3 * 4  # 3 floats per token
    tree.clear()
    assert tree.match(a) == (0, []) and tree.nbytes == 0 and tree.num_tokens == 0


def test_tree_evicts_least_recently_used_leaves_to_its_budget():
    per_token = 3 * 4
    tree = PrefixTree(10 * per_token, token_dims=(0, 1))
    a, b, c = [1] * 4, [2] * 4, [3] * 4
    for s in (a, b):
        tree.insert(s, lambda st, e, s=s: _payload(s, st, e))
    tree.match(a)  # b is now the least recently used
    tree.insert(c, lambda st, e: _payload(c, st, e))
    assert tree.match(b)[0] == 0 and tree.match(a)[0] == 4 and tree.match(c)[0] == 4
    assert tree.nbytes <= tree.budget_bytes and tree.evicted_tokens == 4
    big = list(range(100, 120))  # larger than the budget: not kept
    tree.insert(big, lambda st, e: _payload(big, st, e))
    assert tree.match(big)[0] == 0 and tree.nbytes <= tree.budget_bytes
    off = PrefixTree(0, token_dims=(0, 1))
    assert off.insert(a, lambda st, e: _payload(a, st, e)) == 0 and off.match(a)[0] == 0


def test_common_prefix_len_edges():
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_len([4], [1]) == 0


# ------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("prefix_models")
    return {
        "llama": load_model(
            make_tiny_model(base / "llama", arch="llama", hidden_size=64, num_layers=2, seed=0)
        ),
        "qwen3": load_model(
            make_tiny_model(base / "qwen3", arch="qwen3", hidden_size=64, num_layers=2, seed=1)
        ),
        "moe": load_model(
            make_tiny_model(
                base / "moe",
                arch="qwen3_moe",
                hidden_size=32,
                num_layers=3,
                num_heads=4,
                num_kv_heads=2,
                num_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                seed=3,
            )
        ),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@torch.no_grad()
def test_prefill_after_a_cached_prefix_equals_a_full_prefill(tiny, arch):
    batch = StaticKVBatch(tiny[arch])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (2, 40), generator=g)
    full_logits, full_kv = batch.prefill(ids)
    for P in (1, 17, 39):  # S = 39 ... 1 tokens after the prefix
        prefix = StaticKVBatch.split_payload(StaticKVBatch.payload_of_prefill(full_kv, 0, 0, P))
        logits, kv = batch.prefill(ids[:1, P:].expand(2, -1), prefix)
        assert (logits[0] - full_logits[0]).abs().max() < 2e-5
        assert torch.allclose(kv[0][0][0], full_kv[0][0][0], atol=2e-5)


def _run(engine, prompts, new_tokens=6, **kw):
    """Submit ``prompts`` at once (greedy, with logprobs) and wait; the finished requests."""
    done = threading.Semaphore(0)
    reqs = [
        GenRequest(
            rid=f"r{i}",
            input_ids=list(p),
            on_done=lambda r: done.release(),
            params=SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True),
            **kw,
        )
        for i, p in enumerate(prompts)
    ]
    for r in reqs:
        engine.submit(r)
    for _ in reqs:
        assert done.acquire(timeout=60)
    return reqs


@pytest.fixture
def engines(tiny, request):
    arch = getattr(request, "param", "llama")
    routes = arch == "moe"
    on = BatchedEngine(tiny[arch], eos_token_id=None, prefix_cache_mb=64, capture_routes=routes)
    off = BatchedEngine(tiny[arch], eos_token_id=None, capture_routes=routes)
    try:
        yield on, off
    finally:
        on.shutdown()
        off.shutdown()


def test_group_and_multi_turn_reuse_the_cache_with_the_same_answers(engines):
    on, off = engines
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 100, (IN_BATCH_THRESHOLD + 40,), generator=g).tolist()
    group_on, group_off = _run(on, [prompt] * 8), _run(off, [prompt] * 8)
    L = len(prompt)
    # the first sample is prefilled, the other seven from the cache: all but the last token
    assert sorted(r.cached_tokens for r in group_on) == [0] + [L - 1] * 7
    assert on.prefill_tokens == L + 7 and off.prefill_tokens == 8 * L
    assert on.cached_tokens == 7 * (L - 1) and all(r.cached_tokens == 0 for r in group_off)
    for a, b in zip(group_on, group_off):
        assert a.output_ids == b.output_ids
        assert np.allclose(a.logprobs, b.logprobs, atol=2e-5)
    # a second turn: the first call's prompt and output (but its last token) are cached
    first = group_on[0]
    turn2 = prompt + first.output_ids + [7, 8, 9]
    (t_on,), (t_off,) = _run(on, [turn2]), _run(off, [turn2])
    assert t_on.cached_tokens == L + len(first.output_ids) - 1
    assert t_on.output_ids == t_off.output_ids
    assert np.allclose(t_on.logprobs, t_off.logprobs, atol=2e-5)
    # return_logprob's logprob_start_len caps the prefix (SGLang's adjust_max_prefix_ids)
    (capped,) = _run(on, [turn2], prefix_limit=5)
    assert capped.cached_tokens == 5


def test_weight_update_and_flush_empty_the_cache(engines):
    on, _ = engines
    prompt = list(range(10, 30))
    _run(on, [prompt])
    assert _run(on, [prompt])[0].cached_tokens == len(prompt) - 1
    # a row prefilled before an update is not cached when it finishes after it
    done = threading.Event()
    long = GenRequest(
        rid="long",
        input_ids=list(range(50, 60)),
        on_done=lambda r: done.set(),
        params=SamplingParams(max_new_tokens=10_000, temperature=0.0, ignore_eos=True),
    )
    on.submit(long)
    deadline = time.monotonic() + 60
    while len(long.output_ids) < 3 and time.monotonic() < deadline:  # prefilled, decoding
        time.sleep(0.01)
    on.run_exclusive(on.invalidate_prefix_cache, timeout=30)  # what a weight load does
    on.abort("long")  # leaves the batch after it
    assert done.wait(60) and long.kv_epoch < on.prefix.epoch
    assert _run(on, [prompt])[0].cached_tokens == 0
    assert _run(on, [long.input_ids + long.output_ids])[0].cached_tokens == 0
    # SGLang's flush_cache: refused while a request waits, done when idle
    on.pause()
    waiting = GenRequest(
        rid="w", input_ids=prompt, on_done=lambda r: None, params=SamplingParams(max_new_tokens=2)
    )
    on.submit(waiting)
    assert on.run_exclusive(on.flush_prefix_cache, timeout=30) is False
    on.abort("w")
    on.resume()
    on.run_exclusive(lambda: None, timeout=30)
    assert on.run_exclusive(on.flush_prefix_cache, timeout=30) is True
    assert _run(on, [prompt])[0].cached_tokens == 0


@pytest.mark.parametrize("engines", ["moe"], indirect=True)
def test_routes_of_cached_tokens_are_those_computed_first(engines):
    on, off = engines
    g = torch.Generator().manual_seed(2)
    prompt = torch.randint(3, 100, (IN_BATCH_THRESHOLD + 8,), generator=g).tolist()
    kw = {"return_routed_experts": True}
    group_on, group_off = _run(on, [prompt] * 3, **kw), _run(off, [prompt] * 3, **kw)
    assert sorted(r.cached_tokens for r in group_on)[-1] == len(prompt) - 1
    first = group_on[0]
    turn2 = prompt + first.output_ids + [11, 12]
    (t_on,), (t_off,) = _run(on, [turn2], **kw), _run(off, [turn2], **kw)
    assert t_on.cached_tokens > len(prompt)
    for a, b in zip(group_on + [t_on], group_off + [t_off]):
        assert a.output_ids == b.output_ids
        ra, rb = np.concatenate(a.routes), np.concatenate(b.routes)
        assert ra.shape == rb.shape == (len(a.input_ids) + len(a.output_ids) - 1, 3, 2)
        assert np.array_equal(ra, rb)
