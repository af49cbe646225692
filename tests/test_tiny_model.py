import json

import pytest
import torch

from areal_mega.models.tiny import ARCHS, build_char_tokenizer, make_tiny_model


def test_char_tokenizer_roundtrip():
    tok = build_char_tokenizer("ascii")
    text = "Compute 12+3=?\n\\boxed{15}"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 1 and tok.pad_token_id == 0
    msgs = [{"role": "user", "content": "1+1="}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == "1+1="


@pytest.mark.parametrize("arch", ARCHS)
def test_make_tiny_model_loads_in_transformers(tmp_path, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_tiny_model(tmp_path / arch, arch=arch, tie_word_embeddings=(arch != "qwen2"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("12+3=")["input_ids"]])
    logits = model(ids).logits
    assert logits.shape == (1, 5, cfg["vocab_size"])
    assert torch.isfinite(logits).all()
    # deterministic for the same spec
    again = make_tiny_model(
        tmp_path / (arch + "2"), arch=arch, tie_word_embeddings=(arch != "qwen2")
    )
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_bad_spec(tmp_path):
    with pytest.raises(ValueError, match="arch"):
        make_tiny_model(tmp_path, arch="gpt5")
    with pytest.raises(ValueError, match="unknown tiny-model field"):
        make_tiny_model(tmp_path, hiden_size=3)
