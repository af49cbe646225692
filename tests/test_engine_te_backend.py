"""Attention backend selection, TransformerEngine probing and GPU-fusion decisions (pure
functions, exercised on CPU with fake TE packages and injected facts)."""

import importlib
import sys

import pytest
import torch

from areal_mega.models import backend as B


def _drop_te_modules():
    for name in [m for m in sys.modules if m.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture(autouse=True)
def _no_te_leftovers():
    _drop_te_modules()
    yield
    _drop_te_modules()


def _fake_te(tmp_path, monkeypatch, init_src):
    pkg = tmp_path / "transformer_engine"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(init_src)
    (pkg / "pytorch.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()


@pytest.mark.parametrize(
    "body, err",
    [
        ("raise OSError('libcudnn.so.9: cannot open shared object file')", "libcudnn"),
        ("raise RuntimeError('CUDA driver version is insufficient')", "CUDA driver"),
        ("import transformer_engine_torch_missing_ext", "transformer_engine_torch_missing_ext"),
    ],
)
def test_broken_te_raises_instead_of_meaning_no_te(tmp_path, monkeypatch, body, err):
    _fake_te(tmp_path, monkeypatch, body + "\n")
    st = B.probe_te()
    assert st.state == "broken" and err in st.error
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(B.TEUnusableError, match="fails to import.*attention_backend=local"):
        B.have_te()
    with pytest.raises(B.TEUnusableError, match=err):
        B.resolve_attention("auto")
    assert B.resolve_attention("local") == B.AttentionChoice(False, "local")


def test_working_and_missing_te(tmp_path, monkeypatch):
    assert B.probe_te().state == "missing"  # no TE in this environment
    assert B.have_te(cuda=True) is False and B.have_te(cuda=False) is False
    _fake_te(tmp_path, monkeypatch, "__version__ = '2.18.0'\n")
    assert B.probe_te() == B.TEStatus("ok", version="2.18.0")
    assert B.have_te(cuda=True) is True and B.have_te(cuda=False) is False


def test_missing_te_on_cuda_is_refused_unless_local(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(B.TEUnusableError, match="not installed.*attention_backend=local"):
        B.resolve_attention("auto")
    assert B.resolve_attention("local") == B.AttentionChoice(False, "local")


OK = B.TEStatus("ok", version="2.11.0")
MISSING = B.TEStatus("missing")
BROKEN = B.TEStatus("broken", error="OSError: x")


@pytest.mark.parametrize("backend", ["auto", "flash", "fused", "unfused"])
def test_selection_on_cuda(backend):
    assert B.select_attention(backend, cuda=True, te=OK) == B.AttentionChoice(True, backend)
    for te in (MISSING, BROKEN):
        with pytest.raises(B.TEUnusableError, match="attention_backend"):
            B.select_attention(backend, cuda=True, te=te)
    assert B.select_attention("local", cuda=True, te=te) == B.AttentionChoice(False, "local")


def test_selection_on_cpu():
    assert B.select_attention("auto", cuda=False, te=None) == B.AttentionChoice(False, "local")
    assert B.select_attention("local", cuda=False, te=None) == B.AttentionChoice(False, "local")
    with pytest.raises(B.TEUnusableError, match="model.attention_backend='flash'.*CUDA"):
        B.select_attention("flash", cuda=False, te=None)
    with pytest.raises(ValueError, match="model.attention_backend='sdpa'"):
        B.select_attention("sdpa", cuda=False, te=None)


def test_config_backend_follows_the_process_commitment(monkeypatch):
    for k in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        monkeypatch.delenv(k, raising=False)
    assert B.config_attention_backend(None, use_te=False) == "auto"
    assert B.config_attention_backend("flash", use_te=True) == "flash"
    assert B.config_attention_backend("local", use_te=False) == "local"
    for k, v in (("NVTE_FLASH_ATTN", "1"), ("NVTE_FUSED_ATTN", "0"), ("NVTE_UNFUSED_ATTN", "0")):
        monkeypatch.setenv(k, v)
    assert B.committed_attention_backend() == "flash"
    assert B.config_attention_backend(None, use_te=False) == "flash"  # e.g. the converter
    assert B.config_attention_backend("local", use_te=False) == "flash"
    from megatron.core.transformer.enums import AttnBackend

    assert B.attn_backend_enum("fused") is AttnBackend.fused


def test_fusions_all_off_on_cpu():
    f = B.decide_fusions(cuda=False, use_te=True, te_version="2.11", apex_grad_accum=True)
    assert f == dict(
        apply_rope_fusion=False, bias_activation_fusion=False, gradient_accumulation_fusion=False
    )


def test_fusions_on_gpu_follow_te_and_apex():
    f = B.decide_fusions(cuda=True, use_te=True, te_version="2.11.0+abc", apex_grad_accum=True)
    assert f == dict(
        apply_rope_fusion=True, bias_activation_fusion=True, gradient_accumulation_fusion=True
    )
    f = B.decide_fusions(cuda=True, use_te=False, te_version=None, apex_grad_accum=False)
    assert f == dict(
        apply_rope_fusion=False, bias_activation_fusion=True, gradient_accumulation_fusion=False
    )
    assert not B.decide_fusions(cuda=True, use_te=True, te_version="1.3", apex_grad_accum=False)[
        "apply_rope_fusion"
    ]
    assert not B.decide_fusions(
        cuda=True, use_te=True, te_version="1.11", apex_grad_accum=False, cp=2
    )["apply_rope_fusion"]
    assert B.decide_fusions(cuda=True, use_te=True, te_version="1.12", apex_grad_accum=False, cp=2)[
        "apply_rope_fusion"
    ]
    assert not B.decide_fusions(
        cuda=True, use_te=True, te_version="2.11", apex_grad_accum=False, activation="gelu"
    )["bias_activation_fusion"]


def test_transformer_config_uses_the_fusion_decision(monkeypatch):
    from areal_mega.compat import megatron_cpu

    megatron_cpu.apply()
    from areal_mega.models import builder

    arch = builder.parse_hf_config(
        dict(
            model_type="qwen3",
            vocab_size=100,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
        )
    )
    c = builder.transformer_config_from_hf(arch)
    assert not (c.apply_rope_fusion or c.bias_activation_fusion or c.gradient_accumulation_fusion)
    # "GPU" without TE / apex: only megatron's own fused SwiGLU can be on
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    c = builder.transformer_config_from_hf(arch, use_te=False)
    assert c.bias_activation_fusion and not c.apply_rope_fusion
    assert not c.gradient_accumulation_fusion
