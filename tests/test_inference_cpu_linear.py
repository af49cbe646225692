"""The rollout server's decode speed-ups keep its semantics: oneDNN-prepacked linears give the
model's outputs and follow every weight change; inverse-CDF sampling draws from the
distribution and never picks a token of probability 0."""

import threading

import pytest
import torch
import torch.nn.functional as F

from areal_mega.inference.cpu_linear import (
    onednn_linear_available,
    pack_linear_layers,
    unpack_linear_layers,
)
from areal_mega.inference.decoding import GenRequest
from areal_mega.inference.sampling import SamplingParams, inverse_cdf_pick
from areal_mega.models.tiny import make_tiny_model


def _tiny(tmp_path, name="m", seed=3):
    path = make_tiny_model(
        tmp_path / name,
        arch="llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seed=seed,
    )
    from transformers import AutoModelForCausalLM

    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_onednn_is_available_on_this_torch():
    # the CPU wheel we pin is built with MKLDNN; if a release drops these private ops the
    # server silently falls back to F.linear, and this test says so
    assert onednn_linear_available()


def test_prepacked_model_gives_the_model_outputs(tmp_path):
    _, model = _tiny(tmp_path)
    ids = torch.randint(3, 90, (3, 11), generator=torch.Generator().manual_seed(0))
    want = _logits(model, ids)
    n_linear = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert pack_linear_layers(model) == n_linear > 0
    got = _logits(model, ids)
    assert any("_packed_weight" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    unpack_linear_layers(model)
    assert not any("_packed_weight" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(_logits(model, ids), want, atol=0, rtol=0)


@pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="no bf16 GEMM in oneDNN on this CPU: bf16 weights are packed widened there (below)",
)
def test_prepacked_bf16_model_gives_the_model_outputs(tmp_path, monkeypatch):
    """A bf16 server's linears take oneDNN's prepacked matmul (no panels: they are fp32) at a
    decode step's few rows and at a prefill's many, with the model's outputs."""
    monkeypatch.setenv("AREAL_MEGA_CPU_BF16_GEMM", "native")
    _, model = _tiny(tmp_path)
    model = model.to(torch.bfloat16)
    for rows in (1, 3):
        ids = torch.randint(3, 90, (rows, 11), generator=torch.Generator().manual_seed(rows))
        want = _logits(model, ids)
        pack_linear_layers(model)
        got = _logits(model, ids)
        packed = [
            m.__dict__["_packed_weight"][1]
            for m in model.modules()
            if "_packed_weight" in m.__dict__
        ]
        assert packed and all(p.panels is None and p.onednn is not None for p in packed)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
        unpack_linear_layers(model)


def test_bf16_model_packed_widened_where_the_cpu_has_no_bf16_gemm(tmp_path, monkeypatch):
    """On a CPU without bf16 GEMMs (forced by ``AREAL_MEGA_CPU_BF16_GEMM=fp32``, on any CPU): a
    bf16 server's weights are packed widened to fp32 (the panels too, where built) and its
    products computed in fp32, rounded to bf16: the model's outputs, in bf16."""
    from areal_mega.ops import decode as decode_ops

    monkeypatch.setenv("AREAL_MEGA_CPU_BF16_GEMM", "fp32")
    _, model = _tiny(tmp_path)
    model = model.to(torch.bfloat16)
    for rows in (1, 40):
        ids = torch.randint(3, 90, (rows, 11), generator=torch.Generator().manual_seed(rows))
        want = _logits(model, ids)
        assert pack_linear_layers(model) > 0
        got = _logits(model, ids)
        packed = [
            m.__dict__["_packed_weight"][1]
            for m in model.modules()
            if "_packed_weight" in m.__dict__
        ]
        assert packed and all(p.widened for p in packed)
        if decode_ops.panel_kernels() is not None:
            assert all(p.panels is not None for p in packed)
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)
        layer = model.model.layers[0].mlp.down_proj
        x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(7))
        x = x.bfloat16()
        exact = x.double() @ layer.weight.double().t()
        y = layer(x)
        assert y.dtype == torch.bfloat16
        assert ((y.double() - exact).abs() <= exact.abs() * 2.0**-7 + 1e-6).all()
        unpack_linear_layers(model)


def test_prepacked_weights_follow_in_place_and_replaced_weights(tmp_path):
    _, model = _tiny(tmp_path)
    pack_linear_layers(model)
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(1))
    _logits(model, ids)  # packs every layer once
    sd = model.state_dict()  # how the server writes updates
    name = "model.layers.0.mlp.down_proj.weight"
    with torch.no_grad():
        sd[name].copy_(torch.randn_like(sd[name]))
    got = _logits(model, ids)
    unpack_linear_layers(model)
    torch.testing.assert_close(got, _logits(model, ids), atol=2e-5, rtol=1e-4)

    pack_linear_layers(model)
    _logits(model, ids)
    proj = model.model.layers[1].self_attn.q_proj
    proj.weight = torch.nn.Parameter(torch.randn_like(proj.weight))  # new storage
    got = _logits(model, ids)
    unpack_linear_layers(model)
    torch.testing.assert_close(got, _logits(model, ids), atol=2e-5, rtol=1e-4)


def test_autograd_goes_through_f_linear():
    lin = torch.nn.Linear(8, 5)
    pack_linear_layers(lin)
    x = torch.randn(4, 8, requires_grad=True)
    lin(x).square().sum().backward()
    gx, gw = x.grad.clone(), lin.weight.grad.clone()
    x.grad, lin.weight.grad = None, None
    F.linear(x, lin.weight, lin.bias).square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, lin.weight.grad)
    assert "_packed_weight" not in lin.__dict__


def _greedy(engine, prompt, n):
    done = threading.Event()
    req = GenRequest(
        rid="r",
        input_ids=list(prompt),
        on_done=lambda r: done.set(),
        params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True),
    )
    engine.submit(req)
    assert done.wait(60)
    return req


def test_server_weight_load_reaches_the_prepacked_layers(tmp_path):
    """The production path: LocalRolloutServer.load_from_disk writes the new weights into the
    model on the engine thread; the next request must be generated by the new weights."""
    from areal_mega.inference.server_state import LocalRolloutServer

    path_a, _ = _tiny(tmp_path, "a", seed=3)
    path_b, model_b = _tiny(tmp_path, "b", seed=4)
    srv = LocalRolloutServer(str(path_a), max_running=4)
    try:
        assert srv.engine.prepacked_linears > 0
        prompt = [5, 17, 33, 8, 61]
        before = _greedy(srv.engine, prompt, 6)
        srv.load_from_disk(str(path_b), "1")
        after = _greedy(srv.engine, prompt, 6)
    finally:
        srv.engine.shutdown()
    assert after.weight_version == "1"
    seq = prompt + after.output_ids
    ref = torch.log_softmax(_logits(model_b, torch.tensor([seq]))[0].float(), -1)
    want_tokens = ref[len(prompt) - 1 : -1].argmax(-1).tolist()
    want_lps = [ref[len(prompt) - 1 + i, t].item() for i, t in enumerate(after.output_ids)]
    assert after.output_ids == want_tokens
    assert after.logprobs == pytest.approx(want_lps, abs=1e-4)
    assert before.logprobs != pytest.approx(after.logprobs, abs=1e-4)


def test_inverse_cdf_never_picks_a_zero_probability_token():
    ps = torch.tensor(
        [
            [0.0, 0.0, 0.5, 0.0, 0.5, 0.0],
            [0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
            [3.0, 0.0, 0.0, 0.0, 0.0, 1.0],
        ]
    )  # unnormalised row
    for u in (0.0, 0.25, 0.5, 0.75, 1.0 - 2.0**-53):
        pick = inverse_cdf_pick(ps, torch.full((3,), u, dtype=torch.float64)).tolist()
        assert all(ps[r, i] > 0 for r, i in enumerate(pick)), (u, pick)
    pick = inverse_cdf_pick(ps, torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64))
    assert pick.tolist() == [2, 1, 0]
    pick = inverse_cdf_pick(ps, torch.full((3,), 1.0 - 2.0**-53, dtype=torch.float64))
    assert pick.tolist() == [4, 1, 5]


def test_inverse_cdf_draws_from_the_distribution():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(50, generator=g) * 2, 0)
    n = 200_000
    u = torch.rand(n, dtype=torch.float64, generator=g)
    picks = inverse_cdf_pick(p.expand(n, -1), u)
    freq = torch.bincount(picks, minlength=50).double() / n
    sigma = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((freq - p.double()).abs() <= 5 * sigma + 1e-9).all()
    assert (freq[p == 0] == 0).all()
