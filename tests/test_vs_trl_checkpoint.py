"""``python -m bench.vs_trl --model DIR --data DIR --reward ...`` on a checkpoint the bench did
not build: a tiny Qwen2 saved with ``save_pretrained``, with a byte-level BPE tokenizer trained
here with ``tokenizers`` and a chat template of its own, on chat-form prompts. Smoke size: 2
steps, held-out evaluation before and after. Both sides when TRL's environment (``make
trl-env``, .venv-trl) is there, else ours only (``--ours-only``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HAVE_TRL = (ROOT / ".venv-trl" / "bin" / "python").exists()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<pad>", "<eos>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]


def rows(n: int, seed: int) -> list:
    """Chat-form prompts of the reverse task: ``reverse 4831`` -> ``1384``."""
    import random

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        digits = "".join(rng.choices("0123456789", k=4))
        out.append(
            {
                "prompt": [
                    {"role": "system", "content": "Answer with the digits only."},
                    {"role": "user", "content": f"reverse {digits}"},
                ],
                "answer": digits[::-1],
            }
        )
    return out


def make_checkpoint(out: Path, texts: list) -> None:
    """A byte-level BPE tokenizer trained on ``texts`` (with the chat template) and a tiny
    Qwen2 with random weights, both saved into ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=SPECIAL,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tok.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=len(tok),
            max_position_embeddings=256,
            tie_word_embeddings=True,
            use_sliding_window=False,
            bos_token_id=None,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)


@pytest.mark.slow  # three process launches (ours, TRL, the evaluation server): ~1.5 min loaded
def test_bench_runs_on_a_checkpoint_it_did_not_build(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    train, test = rows(64, seed=1), rows(8, seed=2)
    for name, part in (("train.jsonl", train), ("test.jsonl", test)):
        (data / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    texts = [m["content"] for r in train for m in r["prompt"]] + [r["answer"] for r in train]
    make_checkpoint(tmp_path / "model", texts)
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "bench.vs_trl",
        "--model",
        str(tmp_path / "model"),
        "--data",
        str(data),
        "--reward",
        "areal_mega.rewards:char_match_reward",
        "--steps",
        "2",
        "--prompts",
        "2",
        "--group",
        "2",
        "--max-new",
        "6",
        "--lr",
        "1e-3",
        "--eval-every",
        "2",
        "--out",
        str(out),
    ] + ([] if HAVE_TRL else ["--ours-only"])
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # a run of another length than 16 new tokens is named so (bench.vs_trl.run.run_names)
    res = json.loads((out / "vs_trl-new6.json").read_text())
    assert res["run"]["chat"] is True and res["run"]["arch"] == "Qwen2ForCausalLM"
    # the chat-rendered prompts (system + user turns) are longer than any bare prompt
    assert res["run"]["max_prompt_len"] > 8

    before = res["before"]
    assert 0.0 <= before["pass@1"] <= 1.0 and 0.0 <= before["reward"] <= 1.0
    ours = res["ours"]
    assert [s["step"] for s in ours["steps"]] == [1, 2]
    assert 0.0 <= ours["after"]["pass@1"] <= 1.0
    # the trainer's own evaluations: before the first step and after the last, in time order,
    # start-up included (> 0), the evaluations' own time left out
    assert [q["step"] for q in ours["quality"]] == [0, 2]
    assert 0 < ours["quality"][0]["t"] < ours["quality"][1]["t"] < ours["wall"]
    assert ours["eval_seconds"] > 0
    # the same greedy evaluation of the same weights: the trainer's hook and the CLI agree
    assert ours["quality"][0]["pass@1"] == before["pass@1"]
    assert ours["quality"][-1]["pass@1"] == ours["after"]["pass@1"]

    fl = res["flops"]
    assert all(p["float32"] > 0 and p["bfloat16"] > 0 for p in fl["peak"].values())
    assert fl["ours"]["per_step"]["train"] > fl["ours"]["per_step"]["generate"] > 0
    assert fl["ours"]["flop_s"]["train"] > 0
    text = (out / "vs_trl-new6.txt").read_text()
    assert "time to quality" in text and "achieved GFLOP/s" in text
    assert (out / "vs_trl-new6.png").stat().st_size > 0 or "no plot" in proc.stdout
    if HAVE_TRL:
        trl = res["trl"]
        assert [q["step"] for q in trl["quality"]] == [0, 2]
        assert trl["quality"][0]["pass@1"] == before["pass@1"]
        assert 0 < trl["quality"][0]["t"] < trl["quality"][1]["t"] < trl["wall"]
        assert 0.0 <= trl["after"]["pass@1"] <= 1.0
        assert fl["trl"]["flop_s"]["train"] > 0 and fl["trl"]["flop_s"]["generate"] > 0
        assert set(res["quality"]) >= {"ours_s_to_trl_final", "trl_s_to_ours_final"}
    else:
        assert "trl" not in res and "TRL: not run" in text
