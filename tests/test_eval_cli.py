"""``python -m areal_mega.eval`` end to end on a tiny HF model with CPU rollout servers: at
temperature 0 it reproduces transformers' greedy decoding exactly (same completions, same
rewards), from an HF directory and from one of our Megatron checkpoints alike."""

import json

import pytest
import torch

from areal_mega.data.synthetic import write_task_files
from areal_mega.eval.__main__ import main as eval_main
from areal_mega.eval.scores import summarize
from areal_mega.models.tiny import make_tiny_model
from areal_mega.rewards import load_reward_fn

REWARD = "areal_mega.rewards:char_match_reward"
MAX_NEW = 6


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval_cli")
    model = make_tiny_model(
        d / "model",
        arch="llama",
        charset="digits",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        seed=3,
    )
    _, test = write_task_files(d / "data", task="reverse", n_train=4, n_test=12)
    # a second file whose records name their source: the per-source breakdown uses it
    add = d / "data" / "mixed.jsonl"
    add.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a), "source": "add"}) + "\n"
            for a in range(10, 16)
        )
    )
    return model, test, add


@torch.no_grad()
def hf_greedy(model_dir, data_files):
    """transformers' greedy decoding of every prompt (raw text, as --chat-template off)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reward = load_reward_fn(REWARD)
    out = []
    for f in data_files:
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            ids = tok(rec["prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"]
            gen = model.generate(
                ids,
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id,
            )
            new = gen[0, ids.shape[1] :].tolist()
            finish = "stop" if new and new[-1] == tok.eos_token_id else "length"
            text = tok.decode(new, skip_special_tokens=True)
            out.append(
                {
                    "output_ids": new,
                    "completion": text,
                    "finish": finish,
                    "reward": reward(rec["prompt"], text, rec["answer"], finish_reason=finish),
                }
            )
    return out


def _common(data, out, *extra):
    return [
        "--data",
        *map(str, data),
        "--temperature",
        "0",
        "--n-samples",
        "2",
        "--max-new-tokens",
        str(MAX_NEW),
        "--reward-fn",
        REWARD,
        "--chat-template",
        "off",
        "--pass-threshold",
        "0.2",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


@pytest.fixture(scope="module")
def greedy_run(assets, tmp_path_factory):
    """``python -m areal_mega.eval --model`` at temperature 0, 2 samples, on both files."""
    model, test, add = assets
    out = tmp_path_factory.mktemp("greedy") / "r.json"
    return eval_main(["--model", str(model), *_common([test, add], out)]), out


def test_greedy_eval_equals_transformers_generate(assets, greedy_run):
    model, test, add = assets
    res, out = greedy_run
    want = hf_greedy(model, [test, add])
    recs = res["records"]
    assert len(recs) == len(want) == 18
    for rec, w in zip(recs, want):
        # both samples of a greedy request are the same, and equal to transformers' greedy
        assert rec["output_ids"] == [w["output_ids"]] * 2
        assert rec["completions"] == [w["completion"]] * 2
        assert rec["finish_reasons"] == [w["finish"]] * 2
        assert rec["rewards"] == [pytest.approx(w["reward"])] * 2
    s = res["summary"]
    hf_pass = sum(w["reward"] >= 0.2 for w in want) / len(want)
    assert s["overall"]["pass@1"] == pytest.approx(hf_pass)
    assert s["overall"]["pass@2"] == pytest.approx(hf_pass)  # identical samples
    assert s["overall"]["reward"] == pytest.approx(sum(w["reward"] for w in want) / 18)
    assert s["overall"]["truncation_rate"] == pytest.approx(
        sum(w["finish"] == "length" for w in want) / 18
    )
    assert set(s["per_source"]) == {"test", "add"}
    assert s["per_source"]["add"]["n_prompts"] == 6
    written = json.loads(out.read_text())
    assert written["summary"] == s and written["settings"]["n_samples"] == 2
    assert summarize(written["records"], 0.2) == s


def test_eval_of_a_megatron_checkpoint_equals_its_hf_model(assets, greedy_run, tmp_path):
    """--checkpoint converts one of our checkpoints (here a TP=2 layout) to HF first; the
    evaluation equals the one of the HF model it was converted from."""
    from areal_mega.checkpoint.convert import convert_hf_to_mcore

    model, test, add = assets
    ckpt = tmp_path / "ckpt"
    convert_hf_to_mcore(
        model, ckpt, tp=2, dtype="fp32", make_vocab_size_divisible_by=1, progress=False
    )
    a = eval_main(["--checkpoint", str(ckpt), *_common([test, add], tmp_path / "a.json")])
    b = greedy_run[0]
    assert [r["output_ids"] for r in a["records"]] == [r["output_ids"] for r in b["records"]]
    assert a["summary"] == b["summary"]
    assert a["settings"]["checkpoint"] == str(ckpt)


def test_bad_input_is_one_line_naming_it(assets, tmp_path, capsys):
    from areal_mega.eval.__main__ import cli

    model, test, _ = assets
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1=", "answer": "1"}) + "\n")
    cases = [
        (["--model", str(model), "--data", str(tmp_path / "none.jsonl")], "not found"),
        (["--model", str(model), "--data", str(bad)], "missing field 'prompt'"),
        (["--model", str(tmp_path), "--data", str(test)], "not an HF model directory"),
        (["--checkpoint", str(tmp_path), "--data", str(test)], "no complete checkpoint"),
        (
            ["--model", str(model), "--data", str(test), "--reward-fn", "no_such:fn"],
            "cannot import",
        ),
    ]
    for argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            cli(argv + ["--out", str(tmp_path / "r.json")])
        assert e.value.code == 2
        assert msg in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()
