"""Where this CPU has no bf16 GEMMs, bf16 products are computed in fp32: the switch."""

import pytest
import torch

from areal_mega.common import cpu_bf16


def test_the_switch_follows_the_cpu_unless_told(monkeypatch):
    monkeypatch.delenv(cpu_bf16.BF16_GEMM_ENV, raising=False)
    assert cpu_bf16.bf16_products_in_fp32() is (not cpu_bf16.has_bf16_gemm())
    assert cpu_bf16.has_bf16_gemm() is bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    bf, f32 = torch.zeros(2, dtype=torch.bfloat16), torch.zeros(2)
    for value, want in (("fp32", True), (" FP32 ", True), ("native", False), ("", None)):
        monkeypatch.setenv(cpu_bf16.BF16_GEMM_ENV, value)
        want = (not cpu_bf16.has_bf16_gemm()) if want is None else want
        assert cpu_bf16.bf16_products_in_fp32() is want
        assert cpu_bf16.bf16_in_fp32(bf, bf) is want
        assert not cpu_bf16.bf16_in_fp32(bf, f32)  # an fp32 operand: not a bf16 product
        assert not cpu_bf16.bf16_in_fp32(f32)


def test_a_bad_value_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(cpu_bf16.BF16_GEMM_ENV, "bf16")
    with pytest.raises(ValueError, match=r"AREAL_MEGA_CPU_BF16_GEMM='bf16'.*auto, fp32, native"):
        cpu_bf16.bf16_products_in_fp32()
