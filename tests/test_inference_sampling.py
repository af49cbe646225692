"""SGLang's sampling parameters: the per-step math (choose_tokens on hand-made logits) and the
server's /generate behaviour (stop strings, n, min_new_tokens, penalties, special tokens)."""

import math
from types import SimpleNamespace

import pytest
import torch

from areal_mega.inference.sampling import (
    SamplingParams,
    _choose,
    _temperature_only,
    adjust_logits,
    choose_tokens,
    choose_tokens_isolated,
)
from tests.helpers.rollout import http

pytestmark = pytest.mark.timeout(300)


def req(output_ids=(), **kw):
    return SimpleNamespace(params=SamplingParams(**kw), output_ids=list(output_ids), generator=None)


def test_penalties_apply_to_generated_tokens_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    r = req([0, 0, 1], frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0)
    z = adjust_logits([r], logits, frozenset())
    # token 0: 2 - 0.5*2 - 0.25 = 0.75 -> /2; token 1: -1 - 0.5 - 0.25 = -1.75 -> *2
    assert torch.allclose(z, torch.tensor([[0.375, -3.5, 0.5, 1.0]]))


def test_min_new_tokens_masks_stop_and_eos_then_releases():
    logits = torch.tensor([[0.0, 5.0, 0.0, 4.0]])
    early = req([2], min_new_tokens=2, stop_token_ids=(3,), temperature=0.0)
    toks, lps, _ = choose_tokens([early], logits, frozenset([1]))
    assert toks == [0] and lps[0] == pytest.approx(math.log(0.5))
    later = req([2, 2], min_new_tokens=2, stop_token_ids=(3,), temperature=0.0)
    assert choose_tokens([later], logits, frozenset([1]))[0] == [1]


def test_logprob_is_of_temperature_scaled_distribution_before_truncation():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    r = req(temperature=0.5, top_k=2, min_p=0.1, logit_bias={0: 1.0})
    toks, lps, top = choose_tokens([r], logits, frozenset())
    ref = torch.log_softmax(torch.tensor([2.0, 2.0, 3.0, 0.0]) / 0.5, -1)
    assert toks[0] in (0, 2) and math.isclose(lps[0], float(ref[toks[0]]), abs_tol=1e-6)
    r = req(temperature=1.0, min_p=0.5, top_logprobs_num=2)
    toks, _, top = choose_tokens([r], torch.tensor([[3.0, 3.0, -9.0, -9.0]]), frozenset())
    assert toks[0] in (0, 1) and [t for _, t in top[0]] in ([0, 1], [1, 0])


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_temperature_only_rows_take_one_pass_and_pick_what_the_general_path_picks(
    backend, monkeypatch
):
    """A batch whose rows need only their temperature (greedy, top_k = 1, seeded and unseeded
    rows, min_new_tokens already reached) goes through ``sample_rows``; with the same random
    numbers the general path (steps 1-5 in torch) picks the same tokens and logprobs."""
    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", backend)
    V = 5003
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 3
    reqs = [
        req(temperature=1.0),
        req(temperature=0.0),
        req(temperature=0.7, top_k=1),
        req(temperature=1.3),
        req([4, 5], temperature=0.9, min_new_tokens=2),
        req(temperature=0.5),
    ]
    reqs[3].generator = torch.Generator().manual_seed(11)
    assert all(_temperature_only(r, V) for r in reqs)
    assert not _temperature_only(req(top_p=0.9), V)
    assert not _temperature_only(req([1], min_new_tokens=2), V)
    torch.manual_seed(5)
    toks, lps, top, errors = choose_tokens_isolated(reqs, logits, frozenset([0]))
    assert errors == [None] * 6 and top == [[]] * 6
    reqs[3].generator = torch.Generator().manual_seed(11)
    torch.manual_seed(5)
    want_toks, want_lps, _ = _choose(reqs, adjust_logits(reqs, logits, frozenset([0])))
    assert toks == want_toks
    assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-5
    assert toks[1] == int(logits[1].argmax()) and toks[2] == int(logits[2].argmax())
    logits[3, 7] = float("nan")  # one bad row fails alone
    toks, lps, _, errors = choose_tokens_isolated(reqs, logits, frozenset([0]))
    assert toks[3] is None and "not a distribution" in errors[3]
    assert all(e is None for i, e in enumerate(errors) if i != 3)


def gen(server, prompt, **sp):
    status, out = http(
        server, "/generate", {"input_ids": prompt, "return_logprob": True, "sampling_params": sp}
    )
    assert status == 200, out
    return out


def test_stop_string_truncates_text_not_ids(server, models):
    greedy = gen(server, [5, 6, 7], max_new_tokens=10, temperature=0.0, ignore_eos=True)
    text = greedy["text"]
    assert len(text) >= 4
    stop = text[2:4]
    out = gen(server, [5, 6, 7], max_new_tokens=10, temperature=0.0, ignore_eos=True, stop=stop)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    assert out["output_ids"] == greedy["output_ids"][: len(out["output_ids"])]
    kept = gen(
        server,
        [5, 6, 7],
        max_new_tokens=10,
        temperature=0.0,
        ignore_eos=True,
        stop=[stop],
        no_stop_trim=True,
    )
    assert stop in kept["text"]


def test_n_samples_list_and_min_new_tokens(server, models):
    eos = models["ma"].config.eos_token_id
    status, outs = http(
        server,
        "/generate",
        {
            "input_ids": [8, 9],
            "rid": "grp",
            "return_logprob": True,
            "sampling_params": {
                "n": 3,
                "max_new_tokens": 9,
                "min_new_tokens": 4,
                "logit_bias": {str(eos): 100.0},
            },
        },
    )
    assert status == 200 and isinstance(outs, list) and len(outs) == 3
    assert [o["meta_info"]["id"] for o in outs] == ["grp_0", "grp_1", "grp_2"]
    for o in outs:  # EOS is forced by the bias but masked until 4 tokens exist
        assert len(o["output_ids"]) == 5 and o["output_ids"][-1] == eos
        assert eos not in o["output_ids"][:4]
        assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_frequency_penalty_changes_reported_logprobs(server, models):
    out = gen(
        server, [10, 11], max_new_tokens=12, ignore_eos=True, frequency_penalty=1.5, temperature=0.8
    )
    ids, lps = out["output_ids"], [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    with torch.no_grad():
        logits = models["ma"](input_ids=torch.tensor([[10, 11] + ids])).logits[0].float()
    for t, (tok, lp) in enumerate(zip(ids, lps)):
        row = logits[1 + t].clone()
        for prev in ids[:t]:
            row[prev] -= 1.5
        assert abs(float(torch.log_softmax(row / 0.8, -1)[tok]) - lp) <= 1e-4


def test_skip_special_tokens_and_sglang_endpoints(server, models):
    eos = models["ma"].config.eos_token_id
    sp = {"max_new_tokens": 3, "ignore_eos": True, "logit_bias": {str(eos): 100.0}}
    shown = gen(server, [5], skip_special_tokens=False, **sp)
    hidden = gen(server, [5], **sp)
    assert shown["output_ids"] == hidden["output_ids"] == [eos] * 3
    assert "<eos>" in shown["text"] and hidden["text"] == ""
    assert http(server, "/health", key=None)[0] == 200
    assert http(server, "/generate", {"input_ids": [5]}, key=None)[0] == 401
    status, info = http(server, "/model_info")
    assert status == 200 and info["vocab_size"] == models["ma"].config.vocab_size
    status, info = http(server, "/server_info")
    assert status == 200 and "weight_version" in info
    status, body = http(
        server,
        "/update_weights_from_distributed",
        {
            "names": [],
            "dtypes": [],
            "shapes": [],
            "group_name": "none",
            "flush_cache": True,
            "weight_version": "3",
            "load_format": None,
            "abort_all_requests": False,
        },
    )
    assert status == 400 and "not initialised" in body["error"]["message"]
    status, body = http(
        server,
        "/generate",
        {"input_ids": [5], "log_metrics": True, "sampling_params": {"frequency_penalty": 3}},
    )
    assert status == 400 and "frequency_penalty" in body["error"]["message"]
