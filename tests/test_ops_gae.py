import glob
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from areal_mega.ops import packed_gae
from areal_mega.ops.reference import gae_loop_reference
from tests.helpers.cpu_extension import ROOT, ensure_cpu_extension


@pytest.fixture(params=["native", "torch"])
def backend(request, monkeypatch):
    if request.param == "native":
        ensure_cpu_extension()
    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", request.param)
    return request.param


def _packed(lengths, seed=0, pad=3):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    T = int(cu[-1]) + pad  # padding tokens past cu_seqlens[-1]
    rewards = torch.randn(T, generator=g)
    values = torch.randn(T, generator=g)
    boot = torch.randn(len(lengths), generator=g)
    mask = torch.ones(T, dtype=torch.bool)
    # several masked-out spans (environment / tool output), including a sequence's last tokens
    for a, b in [(3, 7), (12, 13), (40, 90), (500, 1200), (20000, 20150), (int(cu[-1]) - 4, T)]:
        mask[a:b] = False
    return rewards, values, cu, boot, mask


LENGTHS = [1, 0, 5, 30, 1, 0, 20000, 64, 0, 2, 333]


@pytest.mark.parametrize("use_boot", [False, True])
@pytest.mark.parametrize("use_mask", [False, True])
def test_gae_matches_loop_reference(backend, use_boot, use_mask):
    r, v, cu, boot, mask = _packed(LENGTHS)
    kw = dict(
        gamma=0.99,
        lam=0.95,
        bootstrap_values=boot if use_boot else None,
        loss_mask=mask if use_mask else None,
    )
    adv, ret = packed_gae(r, v, cu, **kw)
    adv_ref, ret_ref = gae_loop_reference(r, v, cu, **kw)
    assert adv.dtype == torch.float32 and adv.shape == r.shape
    torch.testing.assert_close(adv.double(), adv_ref, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(ret.double(), ret_ref, atol=2e-4, rtol=1e-5)
    assert (adv[int(cu[-1]) :] == 0).all() and (ret[int(cu[-1]) :] == 0).all()
    if use_mask:
        assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    # length-1 sequence: A = r + gamma * bootstrap - v
    expect = r[0] + 0.99 * (boot[0] if use_boot else 0.0) - v[0]
    assert abs(adv[0].item() - expect.item()) < 1e-5
    assert torch.isfinite(adv).all()


def test_gae_mask_skips_tokens_exactly(backend):
    # masked-out tokens are removed from the recurrence: same result as deleting them
    r, v, cu, boot, mask = _packed([50, 70], seed=3, pad=0)
    mask[:] = True
    mask[10:20] = False
    mask[55:60] = False
    adv, _ = packed_gae(r, v, cu, gamma=0.9, lam=0.8, bootstrap_values=boot, loss_mask=mask)
    keep = mask.nonzero().squeeze(1)
    cu2 = torch.tensor([0, int(mask[:50].sum()), int(mask.sum())], dtype=torch.int32)
    adv2, _ = packed_gae(r[keep], v[keep], cu2, gamma=0.9, lam=0.8, bootstrap_values=boot)
    torch.testing.assert_close(adv[keep], adv2, atol=1e-5, rtol=1e-5)


def test_gae_long_sequence_no_overflow(backend):
    # gamma * lambda = 0.95 over 20k tokens: closed forms with 0.95^-t overflow fp32 here
    T = 20000
    r = torch.zeros(T)
    r[-1] = 1.0
    v = torch.zeros(T)
    cu = torch.tensor([0, T], dtype=torch.int32)
    adv, ret = packed_gae(r, v, cu, gamma=1.0, lam=0.95)
    assert torch.isfinite(adv).all()
    expect = torch.pow(torch.tensor(0.95, dtype=torch.float64), torch.arange(T - 1, -1, -1))
    torch.testing.assert_close(adv.double(), expect, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ret, adv)


def test_gae_validation(backend):
    r = torch.zeros(5)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_gae(r, r, torch.tensor([0, 3, 2], dtype=torch.int32), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_gae(r, r, torch.tensor([0, 6], dtype=torch.int32), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match="bootstrap_values"):
        packed_gae(
            r,
            r,
            torch.tensor([0, 5], dtype=torch.int32),
            gamma=1.0,
            lam=1.0,
            bootstrap_values=torch.zeros(2),
        )
    with pytest.raises(ValueError, match="same length"):
        packed_gae(r, torch.zeros(4), torch.tensor([0, 4], dtype=torch.int32), gamma=1.0, lam=1.0)
    adv, ret = packed_gae(
        torch.zeros(0), torch.zeros(0), torch.tensor([0], dtype=torch.int32), gamma=1.0, lam=1.0
    )
    assert adv.numel() == 0 and ret.numel() == 0


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_every_cu_file_compiles_with_nvcc(tmp_path):
    """CI has nvcc but no GPU: a CUDA syntax error must still fail the suite."""
    sources = sorted(glob.glob(str(ROOT / "csrc" / "**" / "*.cu"), recursive=True))
    assert len(sources) >= 2, sources
    for src in sources:
        out = tmp_path / (Path(src).stem + ".o")
        proc = subprocess.run(
            [
                "nvcc",
                "-c",
                "-std=c++17",
                "-O1",
                "-I",
                str(ROOT / "csrc" / "include"),
                src,
                "-o",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"nvcc failed on {src}:\n{proc.stderr[-4000:]}"
        assert out.stat().st_size > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("use_mask", [False, True])
def test_cuda_gae_matches_reference(use_mask, monkeypatch):
    monkeypatch.setenv("AREAL_MEGA_OPS_BACKEND", "native")
    r, v, cu, boot, mask = _packed(LENGTHS)
    kw = dict(gamma=0.99, lam=0.95, bootstrap_values=boot, loss_mask=mask if use_mask else None)
    adv, ret = packed_gae(
        r.cuda(),
        v.cuda(),
        cu.cuda(),
        **{k: (x.cuda() if torch.is_tensor(x) else x) for k, x in kw.items()},
    )
    adv_ref, ret_ref = gae_loop_reference(r, v, cu, **kw)
    torch.testing.assert_close(adv.cpu().double(), adv_ref, atol=5e-4, rtol=1e-4)
    torch.testing.assert_close(ret.cpu().double(), ret_ref, atol=5e-4, rtol=1e-4)
