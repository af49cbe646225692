"""The vLLM client's translations (pure: SGLang's /generate body and answer <-> vLLM's
token-in/token-out route) and the per-token versions the controller takes from an answer. The
real server is in tests/test_vllm_backend.py."""

import subprocess
import sys
from pathlib import Path

import pytest

from areal_mega.backends.clients import client_class, group_handshake
from areal_mega.backends.vllm.client import VLLMClient, sglang_answer_from_vllm, vllm_generate_body
from areal_mega.rollout.client import RolloutClient
from areal_mega.rollout.generate_result import (
    RolloutRequestError,
    generate_body,
    parse_generate_answer,
    sampling_dict,
    token_versions,
)


def test_generate_body_maps_sglang_sampling_names():
    body = generate_body(
        [1, 2, 3],
        sampling_dict(
            8,
            temperature=0.7,
            top_p=0.9,
            top_k=5,
            stop_token_ids=[2],
            ignore_eos=True,
            sampling_seed=11,
            min_new_tokens=2,
            no_stop_trim=True,
        ),
        rid="s0-t0-r1",
    )
    out = vllm_generate_body(body)
    assert out["token_ids"] == [1, 2, 3] and out["request_id"] == "s0-t0-r1"
    sp = out["sampling_params"]
    assert sp == {
        "logprobs": 0,
        "max_tokens": 8,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 5,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "seed": 11,
        "min_tokens": 2,
        "include_stop_str_in_output": True,
        "detokenize": False,
    }


def test_stop_strings_turn_detokenizing_on_and_logit_bias_keys_become_ints():
    sp = vllm_generate_body(generate_body([1], sampling_dict(4, stop=["\n"], logit_bias={"7": -2})))
    assert sp["sampling_params"]["detokenize"] is True
    assert sp["sampling_params"]["logit_bias"] == {7: -2.0}


@pytest.mark.parametrize(
    "body, needle",
    [
        (generate_body([1], sampling_dict(4, json_schema="{}")), "sampling_params.json_schema"),
        (generate_body([1], sampling_dict(4, n=2)), "sampling_params.n=2"),
        (generate_body([1], sampling_dict(4), lora_path="policy-v1"), "lora_path"),
        (generate_body([1], sampling_dict(4), return_routed_experts=True), "return_routed_experts"),
        (
            {
                "input_ids": [1, 2],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
            "logprob_start_len",
        ),  # teacher scoring's body
        (dict(generate_body([1], sampling_dict(4)), stream=True), "stream"),
    ],
)
def test_what_vllm_cannot_honour_is_refused_by_name(body, needle):
    with pytest.raises(RolloutRequestError, match=needle) as e:
        vllm_generate_body(body)
    assert e.value.status == 400


def _answer(ids, lps, reason, spans, cached=0):
    return {
        "request_id": "generate-tokens-x",
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": len(ids),
            "prompt_tokens_details": {"cached_tokens": cached},
        },
        "choices": [
            {
                "index": 0,
                "finish_reason": reason,
                "stop_reason": None,
                "token_ids": ids,
                "weight_versions": spans,
                "logprobs": {
                    "content": [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps)]
                },
            }
        ],
    }


def test_answer_becomes_sglangs_with_per_token_versions():
    raw = _answer(
        [7, 8, 9],
        [-0.5, -1.0, -2.0],
        "length",
        [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}],
        cached=2,
    )
    res = parse_generate_answer(sglang_answer_from_vllm(raw), "http://s")
    assert res.output_ids == [7, 8, 9] and res.logprobs == [-0.5, -1.0, -2.0]
    assert res.finish_reason == {"type": "length", "length": 3} and res.finish_type == "length"
    assert res.weight_version == "4" and token_versions(res, 0) == [3, 3, 4]
    assert res.raw["meta_info"]["cached_tokens"] == 2


def test_aborted_answer_without_tokens_and_stop_answer():
    res = parse_generate_answer(sglang_answer_from_vllm(_answer([], [], "abort", [])), "s")
    assert res.output_ids == [] and res.finish_type == "abort"
    assert token_versions(res, 5) == []
    res = parse_generate_answer(sglang_answer_from_vllm(_answer([1], [-0.1], "stop", [])), "s")
    assert res.finish_type == "stop" and token_versions(res, 5) == [5]


def test_an_answer_without_logprobs_is_refused():
    raw = _answer([7, 8], [-0.5, -1.0], "length", [])
    raw["choices"][0]["logprobs"] = None
    with pytest.raises(RolloutRequestError, match="2 tokens but 0 logprobs"):
        sglang_answer_from_vllm(raw)


def test_token_versions_fall_back_to_the_one_version_then_the_callers():
    res = parse_generate_answer(
        {
            "output_ids": [1, 2],
            "meta_info": {
                "weight_version": "7",
                "output_token_logprobs": [[-1, 1, None], [-1, 2, None]],
            },
        },
        "s",
    )
    assert token_versions(res, 0) == [7, 7]
    res.weight_version = "default"  # vLLM's version before any update: not an int
    assert token_versions(res, 2) == [2, 2]


def test_backend_picks_the_client_and_the_group_handshake():
    assert client_class("vllm") is VLLMClient and group_handshake("vllm") == "vllm"
    for b in ("local", "sglang"):
        assert client_class(b) is RolloutClient and group_handshake(b) == "sglang"
    c = VLLMClient(["127.0.0.1:1"], api_key="k")
    sib = c.sibling(["127.0.0.1:2"])
    assert type(sib) is VLLMClient and sib.api_key == "k" and sib.addrs == ["http://127.0.0.1:2"]


def test_unknown_group_handshake_is_refused():
    from areal_mega.parallel.weight_group import init_update_group

    with pytest.raises(ValueError, match="handshake='ray'"):
        init_update_group("127.0.0.1", 1, 2, 0, "g", handshake="ray")


def test_vllms_processes_import_our_two_modules_alone():
    """vLLM's Python imports the API-key middleware and the worker extension by dotted name
    from this checkout: with no site-packages at all (``-S``), they and their packages'
    ``__init__`` load (the package's megatron-core import finder with it), and nothing else of
    ours."""
    root = Path(__file__).resolve().parents[1]
    code = (
        "import sys, areal_mega.backends.vllm.auth, areal_mega.backends.vllm.worker_extension; "
        "print(sorted(m for m in sys.modules if m.startswith('areal_mega')))"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.strip() == str(
        [
            "areal_mega",
            "areal_mega.backends",
            "areal_mega.backends.vllm",
            "areal_mega.backends.vllm.auth",
            "areal_mega.backends.vllm.worker_extension",
            # the package's megatron-core import finder (stdlib only; it imports nothing until
            # megatron-core is imported)
            "areal_mega.compat",
            "areal_mega.compat.megatron_import",
            "areal_mega.compat.scoped_import",
        ]
    )
