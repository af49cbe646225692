"""The prefix cache through the real CPU server process over HTTP, as SGLang answers: a
multi-turn episode's second call reports its first call as ``cached_tokens``, a group's samples
all but the first, ``/flush_cache`` (200 and SGLang's text when idle) and a weight update from
disk empty it, ``--prefix-cache-mb 0`` turns it off, and the answers equal those of a server
without the cache."""

import urllib.request

import pytest

from areal_mega.inference.process import LocalServerProcess
from areal_mega.inference.server import FLUSH_CACHE_TEXT
from tests.helpers.rollout import API_KEY, http

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def servers(models):
    """One server with the default cache, one with ``--prefix-cache-mb 0``."""
    on = LocalServerProcess(str(models["a"]), api_key=API_KEY)
    off = LocalServerProcess(
        str(models["a"]), api_key=API_KEY, extra_args=["--prefix-cache-mb", "0"]
    )
    try:
        yield on.wait_ready(), off.wait_ready()
    finally:
        on.stop()
        off.stop()


def _generate(server, ids, n=1, new_tokens=5):
    status, out = http(
        server,
        "/generate",
        {
            "input_ids": ids,
            "return_logprob": True,
            "sampling_params": {
                "max_new_tokens": new_tokens,
                "temperature": 0.0,
                "n": n,
                "ignore_eos": True,
            },
        },
    )
    assert status == 200, out
    return out


def _flush(server):
    req = urllib.request.Request(
        f"http://{server.addr}/flush_cache",
        data=b"",
        method="POST",
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return resp.status, resp.read().decode()


def _same(a, b):
    assert a["output_ids"] == b["output_ids"]
    lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
    lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
    assert max(abs(x - y) for x, y in zip(lp_a, lp_b)) < 2e-5


def test_multi_turn_group_flush_and_weight_update(servers, models):
    on, off = servers
    turn1 = [5 + i % 40 for i in range(48)]
    a1, b1 = _generate(on, turn1), _generate(off, turn1)
    assert a1["meta_info"]["cached_tokens"] == 0
    _same(a1, b1)
    # the episode's next call: the first call's prompt and output (but its last token)
    turn2 = turn1 + a1["output_ids"] + [9, 10, 11]
    a2, b2 = _generate(on, turn2), _generate(off, turn2)
    assert a2["meta_info"]["cached_tokens"] == len(turn1) + len(a1["output_ids"]) - 1
    assert b2["meta_info"]["cached_tokens"] == 0
    _same(a2, b2)
    # a group of 8 samples of a new prompt: prefilled once, the others all but the last token
    prompt = [60 - i % 30 for i in range(64)]
    before = http(on, "/server_info")[1]
    group = _generate(on, prompt, n=8)
    after = http(on, "/server_info")[1]
    assert sorted(g["meta_info"]["cached_tokens"] for g in group) == [0] + [63] * 7
    assert after["prefill_tokens"] - before["prefill_tokens"] == 64 + 7
    assert after["cached_tokens"] - before["cached_tokens"] == 7 * 63
    assert after["forward_seconds"]["prefill"] > before["forward_seconds"]["prefill"]
    assert (
        after["prefix_cache"]["tokens"] > 0 and http(off, "/server_info")[1]["prefix_cache"] is None
    )
    # SGLang's /flush_cache: 200 and its text when idle; the cache is empty after it
    assert _flush(on) == (200, FLUSH_CACHE_TEXT)
    assert _generate(on, turn2)["meta_info"]["cached_tokens"] == 0
    assert _generate(on, turn2)["meta_info"]["cached_tokens"] == len(turn2) - 1
    # a weight update from disk empties it: new weights, nothing cached, same as a fresh server
    status, out = http(on, "/update_weights_from_disk", {"model_path": str(models["b"])})
    assert status == 200, out
    fresh = _generate(on, turn2)
    assert fresh["meta_info"]["cached_tokens"] == 0
    status, _ = http(off, "/update_weights_from_disk", {"model_path": str(models["b"])})
    assert status == 200
    _same(fresh, _generate(off, turn2))
    http(on, "/update_weights_from_disk", {"model_path": str(models["a"])})
    http(off, "/update_weights_from_disk", {"model_path": str(models["a"])})


def test_every_weight_load_path_empties_the_cache(models):
    """Disk and distributed loads both copy weights through ``_assign`` on the engine thread:
    in process, a load empties the cache and moves its epoch (no row of the old weights is
    added afterwards)."""
    from areal_mega.inference.decoding import GenRequest
    from areal_mega.inference.sampling import SamplingParams
    from areal_mega.inference.server_state import LocalRolloutServer

    srv = LocalRolloutServer(str(models["a"]))
    try:

        def generate():
            done = []
            r = GenRequest(
                rid="x",
                input_ids=list(range(5, 45)),
                on_done=done.append,
                params=SamplingParams(max_new_tokens=3, temperature=0.0),
            )
            srv.engine.submit(r)
            srv.engine.run_exclusive(lambda: None, timeout=60)
            while not done:
                srv.engine.run_exclusive(lambda: None, timeout=60)
            return r

        generate()
        assert srv.engine.prefix.stats()["tokens"] > 0
        epoch = srv.engine.prefix.epoch
        tensors = {k: v.clone() for k, v in models["mb"].state_dict().items()}
        srv.engine.run_exclusive(lambda: srv._assign(tensors, "7"), timeout=60)  # distributed
        assert srv.engine.prefix.stats()["tokens"] == 0 and srv.engine.prefix.epoch > epoch
        assert generate().cached_tokens == 0
        srv.load_from_disk(str(models["a"]), "8")  # disk
        assert srv.engine.prefix.stats()["tokens"] == 0 and generate().cached_tokens == 0
    finally:
        srv.engine.shutdown()
