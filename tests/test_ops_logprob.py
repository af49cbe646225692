import pytest
import torch

from areal_mega.ops import packed_logprobs, packed_logprobs_from_hidden
from areal_mega.ops.reference import logprobs_naive
from tests.helpers.cpu_extension import ensure_cpu_extension

# the C++ kernels once per vector ISA (AVX-512, AVX2, SSE2 builds, chosen at run time), and torch
BACKENDS = ["native-avx512", "native-avx2", "native-generic", "torch"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    name = request.param
    if name.startswith("native"):
        ensure_cpu_extension()
        from areal_mega import _ops_cpu

        isa = name.split("-", 1)[1]
        got = _ops_cpu.set_cpu_isa(isa)
        request.addfinalizer(lambda: _ops_cpu.set_cpu_isa("default"))
        if got != isa:
            pytest.skip(f"this CPU has no {isa} (the kernels run {got})")
        name = "native"
    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", name)
    return name


def _batch(T, V, dtype, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(T, V, generator=g, dtype=torch.float64) * scale).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    return logits, labels


@pytest.mark.parametrize(
    "dtype, tol, gtol",
    [(torch.float32, 2e-5, 1e-6), (torch.bfloat16, 2e-5, 1e-2), (torch.float16, 2e-5, 2e-3)],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_backward_match_reference(backend, dtype, tol, gtol, temperature):
    # V = 5003 is not a multiple of any block/vector width; label -1 is padding
    logits, labels = _batch(48, 5003, dtype)
    labels[5] = -1
    labels[6] = 5002
    x = logits.clone().requires_grad_()
    lp, ent = packed_logprobs(x, labels, temperature=temperature, return_entropy=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32 and lp.shape == (48,)
    ref = logits.double().requires_grad_()
    lp_ref, ent_ref = logprobs_naive(ref, labels, temperature=temperature, return_entropy=True)
    torch.testing.assert_close(lp.double(), lp_ref.detach(), atol=tol * 10, rtol=tol)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), atol=tol * 10, rtol=tol)
    assert lp[5] == 0
    g = torch.Generator().manual_seed(1)
    g_lp = torch.randn(48, dtype=torch.float64, generator=g)
    g_ent = torch.randn(48, dtype=torch.float64, generator=g)
    (gx,) = torch.autograd.grad((lp * g_lp.float()).sum() + (ent * g_ent.float()).sum(), x)
    (gref,) = torch.autograd.grad((lp_ref * g_lp).sum() + (ent_ref * g_ent).sum(), ref)
    assert gx.dtype == dtype and gx.shape == logits.shape
    scale = gref.abs().max().item()
    torch.testing.assert_close(gx.double(), gref, atol=gtol * scale + 1e-7, rtol=gtol)
    # logprob-only gradient path (no entropy statistics kept)
    x2 = logits.clone().requires_grad_()
    (gx2,) = torch.autograd.grad(
        (packed_logprobs(x2, labels, temperature=temperature) * g_lp.float()).sum(), x2
    )
    (gref2,) = torch.autograd.grad(
        (logprobs_naive(ref, labels, temperature=temperature) * g_lp).sum(), ref
    )
    torch.testing.assert_close(gx2.double(), gref2, atol=gtol * scale + 1e-7, rtol=gtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("entropy", [False, True])
def test_gradient_written_over_the_logits_equals_a_new_one(backend, dtype, entropy):
    """grad_in_logits: the backward writes the gradient over the logits, bit for bit the one
    of a new buffer (V = 5003: several blocks; labels in the first and last of them, and
    padding); the logits' storage holds it and their version moves on."""
    from areal_mega.ops import logits_read_by_loss_only

    logits, labels = _batch(24, 5003, dtype)
    labels[3], labels[4], labels[5], labels[6] = -1, 5002, 0, 2100
    wdtype = torch.float64 if dtype == torch.float64 else torch.float32
    w = torch.randn(24, generator=torch.Generator().manual_seed(2), dtype=torch.float64).to(wdtype)
    grads = {}
    for over in (False, True):
        leaf = logits.clone().requires_grad_()
        x = leaf.clone()  # a producer that does not read its output (as the output layer)
        assert logits_read_by_loss_only(x) and logits_read_by_loss_only(x.view(24, 5003))
        out = packed_logprobs(
            x, labels, temperature=0.7, return_entropy=entropy, grad_in_logits=over
        )
        lp, ent = out if entropy else (out, None)
        loss = (lp * w).sum() + (0.3 * (ent * w).sum() if entropy else 0)
        version = x._version
        (grads[over],) = torch.autograd.grad(loss, leaf)
        assert (grads[over].data_ptr() == x.data_ptr()) == over
        assert (x._version > version) == over
    assert torch.equal(grads[True], grads[False])


def test_logits_another_node_saved_are_not_overwritten_silently(backend):
    """Logits a node saved for its backward are not read by the loss only; forcing
    grad_in_logits there makes that node's backward fail loudly, not read the gradient."""
    from areal_mega.ops import logits_read_by_loss_only

    logits, labels = _batch(8, 300, torch.float32)
    leaf = logits.clone().requires_grad_()
    assert not logits_read_by_loss_only(leaf)  # a leaf: the caller holds it
    assert not logits_read_by_loss_only(leaf.exp())  # exp's backward reads its output
    x = leaf.clone()
    other = x.square().sum()  # saves x; runs its backward after the loss's
    lp = packed_logprobs(x, labels, grad_in_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (lp.sum() + other).backward()


def test_gradcheck_fp64(backend):
    logits, labels = _batch(6, 37, torch.float64, seed=1, scale=1.0)
    labels[2] = -1
    x = logits.requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: packed_logprobs(z, labels, temperature=1.3, return_entropy=True), (x,)
    )
    assert torch.autograd.gradcheck(lambda z: packed_logprobs(z, labels, temperature=0.5), (x,))


def test_masked_vocabulary_and_extremes(backend):
    logits, labels = _batch(8, 3000, torch.float32, seed=2)
    logits[0, 100:2900] = float("-inf")  # e.g. a vocabulary mask
    labels[0] = 5
    logits[1] *= 1e3  # very peaked row
    logits[2] = 0.0  # uniform row: entropy = log V
    x = logits.clone().requires_grad_()
    lp, ent = packed_logprobs(x, labels, return_entropy=True)
    lp_ref, ent_ref = logprobs_naive(logits.double(), labels, return_entropy=True)
    torch.testing.assert_close(lp.double(), lp_ref, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, atol=1e-4, rtol=1e-5)
    assert abs(ent[2].item() - torch.log(torch.tensor(3000.0)).item()) < 1e-5
    (lp.sum() + ent.sum()).backward()
    assert torch.isfinite(x.grad).all()
    assert (x.grad[0, 100:2900] == 0).all()


def test_empty_batch_and_validation(backend):
    lp = packed_logprobs(torch.zeros(0, 11), torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,)
    with pytest.raises(ValueError, match=r"\[T, V_local\]"):
        packed_logprobs(torch.zeros(4), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must be"):
        packed_logprobs(torch.zeros(4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        packed_logprobs(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(TypeError, match="integer"):
        packed_logprobs(torch.zeros(4, 5), torch.zeros(4))


def test_non_contiguous_rows_and_chunking(backend):
    big, labels = _batch(20, 900, torch.float32, seed=3)
    view = big[:, :700]  # row stride 900, unit column stride
    labels = labels % 700
    lp = packed_logprobs(view, labels, chunk_size=3, temperature=1.7)
    ref = logprobs_naive(view.double(), labels, temperature=1.7)
    torch.testing.assert_close(lp.double(), ref, atol=2e-5, rtol=1e-5)


def test_fused_from_hidden_matches_full_logits(backend):
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(70, 32, generator=g)
    weight = torch.randn(1001, 32, generator=g) / 4
    labels = torch.randint(0, 1001, (70,), generator=g)
    labels[3] = -1
    lp, ent = packed_logprobs_from_hidden(
        hidden,
        weight,
        labels,
        temperature=0.8,
        token_chunk=16,
        vocab_chunk=300,
        return_entropy=True,
    )
    lp_ref, ent_ref = logprobs_naive(
        (hidden.double() @ weight.double().T), labels, temperature=0.8, return_entropy=True
    )
    torch.testing.assert_close(lp.double(), lp_ref, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref, atol=5e-5, rtol=1e-5)
    assert not lp.requires_grad


def test_native_backend_error_names_build_command(monkeypatch):
    from areal_mega.ops import _backend

    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", "native")
    monkeypatch.setitem(_backend._modules, "_ops_cpu", None)
    monkeypatch.setitem(_backend._errors, "_ops_cpu", ImportError("simulated"))
    with pytest.raises(RuntimeError, match="setup.py build_ext --inplace"):
        packed_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", "bogus")
    with pytest.raises(ValueError, match="AREAL_MEGA_OPS_BACKEND='bogus'.*auto, native, torch"):
        packed_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_cuda_matches_reference(dtype, monkeypatch):
    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", "native")
    logits, labels = _batch(64, 151936 // 8, dtype)
    labels[1] = -1
    x = logits.cuda().requires_grad_()
    lp, ent = packed_logprobs(x, labels.cuda(), temperature=0.9, return_entropy=True)
    ref = logits.double().requires_grad_()
    lp_ref, ent_ref = logprobs_naive(ref, labels, temperature=0.9, return_entropy=True)
    torch.testing.assert_close(lp.cpu().double(), lp_ref.detach(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(ent.cpu().double(), ent_ref.detach(), atol=1e-4, rtol=1e-5)
    (gx,) = torch.autograd.grad(lp.sum() + ent.sum(), x)
    (gref,) = torch.autograd.grad(lp_ref.sum() + ent_ref.sum(), ref)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(
        gx.cpu().double(), gref, atol=tol * gref.abs().max().item(), rtol=tol
    )


@pytest.mark.parametrize("value, ok", [("avx2", True), ("sse9", False)])
def test_kernel_isa_env_caps_the_build_or_is_refused(value, ok):
    """AREAL_MEGA_KERNEL_ISA reaches the C++ dispatch; a value it does not know is an error
    naming the variable, not a silent fall back to the best ISA."""
    import os
    import subprocess
    import sys

    ensure_cpu_extension()
    code = (
        "import torch; from areal_mega.ops import packed_logprobs; "
        "from areal_mega import _ops_cpu; "
        "packed_logprobs(torch.randn(2, 7), torch.tensor([1, 2])); print(_ops_cpu.cpu_isa())"
    )
    env = dict(os.environ, AREAL_MEGA_KERNEL_ISA=value, AREAL_MEGA_OPS_BACKEND="native")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    if ok:
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() in ("avx2", "generic")  # capped at what the CPU has
    else:
        assert out.returncode != 0
        assert (
            "AREAL_MEGA_KERNEL_ISA='sse9'" in out.stderr and "avx512, avx2, generic" in out.stderr
        ), out.stderr[-2000:]
