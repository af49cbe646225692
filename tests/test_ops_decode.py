"""The rollout server's decode-step kernels (csrc/decode/) equal their torch references under
every vector ISA the CPU has: RMSNorm, one-query attention over a KV cache (which also writes
the new keys and values), per-row token choice, and the few-rows matmul on panel-packed
weights."""

import pytest
import torch
import torch.nn.functional as F

from areal_mega.ops import decode as dops
from tests.helpers.cpu_extension import ensure_cpu_extension

ISAS = ["avx512", "avx2", "generic"]


@pytest.fixture(params=ISAS)
def native(request):
    ops = ensure_cpu_extension()
    got = ops.set_cpu_isa(request.param)
    request.addfinalizer(lambda: ops.set_cpu_isa("default"))
    if got != request.param:
        pytest.skip(f"this CPU has no {request.param} (the kernels run {got})")
    return ops


@pytest.mark.parametrize("shape", [(8, 576), (3, 1, 64), (5, 7), (2, 4, 3, 33)])
def test_rms_norm_matches_torch(native, shape):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
    got = native.rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got, F.rms_norm(x, (shape[-1],), w, 1e-6), atol=2e-6, rtol=1e-5)
    strided = torch.stack([x, -x], -1)[..., 0]  # a non-contiguous input
    assert not strided.is_contiguous()
    torch.testing.assert_close(native.rms_norm(strided, w, 1e-6), got, atol=0, rtol=0)


@pytest.mark.parametrize(
    "B, Hkv, G, D, window",
    [
        (8, 3, 3, 64, 0),
        (5, 2, 1, 13, 0),
        (6, 3, 3, 64, 5),
        (4, 1, 4, 128, 0),
        (3, 2, 2, 32, 1),
        (2, 4, 1, 8, 0),
    ],
)
def test_decode_attention_matches_the_masked_matmuls(native, monkeypatch, B, Hkv, G, D, window):
    g = torch.Generator().manual_seed(B * 100 + D)
    cap = 48
    kc = torch.randn(B + 2, Hkv, cap, D, generator=g)
    vc = torch.randn(B + 2, Hkv, cap, D, generator=g)
    pos = torch.randint(0, 40, (B,), generator=g)
    pos[0] = 0  # a row with one key: its own
    q = torch.randn(B, Hkv * G, D, generator=g)
    kn, vn = torch.randn(B, Hkv, D, generator=g), torch.randn(B, Hkv, D, generator=g)
    kr, vr = kc.clone(), vc.clone()
    want = dops.decode_attention_reference(q, kn, vn, kr, vr, pos, D**-0.5, window)
    got = native.decode_attention(q, kn, vn, kc, vc, pos, D**-0.5, window)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)  # the new keys/values written
    torch.testing.assert_close(got[0], vn[0].repeat_interleave(G, 0), atol=1e-6, rtol=0)
    # the dispatching wrapper takes the kernel here; the torch backend takes the reference
    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", "torch")
    torch.testing.assert_close(
        dops.decode_attention(q, kn, vn, kc.clone(), vc.clone(), pos, D**-0.5, window), want
    )


def test_decode_attention_refuses_a_position_outside_the_cache(native):
    kc, vc = torch.zeros(2, 1, 8, 4), torch.zeros(2, 1, 8, 4)
    q, kn = torch.zeros(2, 1, 4), torch.zeros(2, 1, 4)
    with pytest.raises(RuntimeError, match="position outside the cache"):
        native.decode_attention(q, kn, kn, kc, vc, torch.tensor([3, 8]), 1.0, 0)
    with pytest.raises(RuntimeError, match="query heads for"):
        native.decode_attention(
            torch.zeros(2, 3, 4),
            torch.zeros(2, 2, 4),
            torch.zeros(2, 2, 4),
            torch.zeros(2, 2, 8, 4),
            torch.zeros(2, 2, 8, 4),
            torch.tensor([0, 1]),
            1.0,
            0,
        )


def _rows(B, V, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * 4
    temps = torch.rand(B, generator=g) + 0.3
    temps[0] = 1.0
    u = torch.rand(B, generator=g, dtype=torch.float64)
    greedy = torch.zeros(B, dtype=torch.bool)
    greedy[1] = True
    return logits, temps, u, greedy


@pytest.mark.parametrize("B, V", [(9, 50), (4, 5003), (3, 49152)])
def test_sample_rows_matches_the_inverse_cdf_of_log_softmax(native, B, V):
    logits, temps, u, greedy = _rows(B, V, seed=V)
    logits[2, : V // 2] = float("-inf")  # half the tokens impossible
    tok, lp, bad = native.sample_rows(logits, temps, u, greedy)
    rtok, rlp, rbad = dops.sample_rows_reference(logits, temps, u, greedy)
    assert not bad.any() and not rbad.any()
    assert torch.equal(tok, rtok)
    assert int(tok[1]) == int((logits[1] / temps[1]).argmax())
    assert int(tok[2]) >= V // 2
    torch.testing.assert_close(lp, rlp, atol=1e-5, rtol=1e-5)


def test_sample_rows_flags_rows_that_are_no_distribution(native):
    logits, temps, u, greedy = _rows(5, 64, seed=1)
    logits[0, 3] = float("nan")
    logits[2, 10] = float("inf")
    logits[3] = float("-inf")
    temps[4] = 1e-40  # finite / tiny -> +inf
    tok, lp, bad = native.sample_rows(logits, temps, u, greedy)
    assert bad.tolist() == [True, False, True, True, True]
    assert tok[bad].tolist() == [-1] * 4
    rtok, _, rbad = dops.sample_rows_reference(logits, temps, u, greedy)
    assert torch.equal(bad, rbad) and int(tok[1]) == int(rtok[1])


def test_sample_rows_edges_of_the_uniform_and_the_distribution(native):
    # u = 0 picks the first token of nonzero probability; u just below 1 the last one
    logits = torch.full((2, 10), float("-inf"))
    logits[:, [2, 5, 7]] = torch.tensor([0.0, 1.0, 2.0])
    u = torch.tensor([0.0, 1.0 - 2.0**-53], dtype=torch.float64)
    tok, lp, _ = native.sample_rows(logits, torch.ones(2), u, torch.zeros(2, dtype=torch.bool))
    assert tok.tolist() == [2, 7]
    want = torch.log_softmax(logits, -1)[[0, 1], [2, 7]]
    torch.testing.assert_close(lp, want)
    # frequencies follow softmax: 20k draws of a 4-token row
    p = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 20000
    rows = p.log().expand(n, -1).contiguous()
    u = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    tok, _, _ = native.sample_rows(rows, torch.ones(n), u, torch.zeros(n, dtype=torch.bool))
    freq = torch.bincount(tok, minlength=4).double() / n
    assert (freq - p.double()).abs().max() < 0.015


@pytest.mark.parametrize("M", [0, 1, 3, 4, 5, 8, 32, 33])
@pytest.mark.parametrize(
    "N, K, with_bias", [(70, 33, True), (576, 576, False), (96, 300, True), (5, 1, False)]
)
def test_gemm_panels_match_f_linear(native, M, N, K, with_bias):
    g = torch.Generator().manual_seed(M * 7 + N)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    panels = native.pack_gemm_panels(w)
    nr = native.gemm_panel_width()
    assert panels.shape == ((N + nr - 1) // nr, K, nr)
    assert torch.equal(dops.unpack_gemm_panels(panels, N), w)
    got = native.gemm_panels(x, panels, N, b)
    assert got.shape == (M, N)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, 3, K, generator=g)  # leading dims kept
    torch.testing.assert_close(
        native.gemm_panels(x3, panels, N, b), F.linear(x3, w, b), atol=1e-4, rtol=1e-5
    )


def test_gemm_panels_refuse_a_pack_of_another_width_or_size(native):
    w = torch.randn(40, 16)
    panels = native.pack_gemm_panels(w)
    with pytest.raises(RuntimeError, match="does not match"):
        native.gemm_panels(torch.randn(2, 16), panels, 400, None)
    with pytest.raises(RuntimeError, match="features"):
        native.gemm_panels(torch.randn(2, 15), panels, 40, None)
    with pytest.raises(RuntimeError, match="pack_gemm_panels under the ISA in use"):
        native.gemm_panels(torch.randn(2, 16), panels[..., :-1].contiguous(), 40, None)
