"""An HF reward/value model (``Qwen2ForSequenceClassification``, num_labels=1) as
``critic.path``: its body converts into the critic's trunk and its ``score`` head becomes the
value head, so the critic's initial values on a packed batch are transformers' per-token
scores (``score(hidden)[..., 0]`` at every position, before the last-token pooling), at TP1
and TP2 (gloo, tests/helpers/score_critic_worker.py). Bad value models get one clear error; the
actor's conversion stays strict."""

import json
import os

import pytest
import torch

from areal_mega.checkpoint.convert import convert_hf_to_mcore
from areal_mega.checkpoint.hf_mapping import UnsupportedModelError
from areal_mega.common.net import free_port
from areal_mega.config import ConfigError, check_against_model, load_config
from tests.helpers.multirank import rank_results, run_ranks
from tests.helpers.workers import worker_cmd

WORKER = "score_critic_worker"  # tests.helpers.score_critic_worker
SEQ_LENS = (7, 12, 4)
TOL = 1e-5


def save_reward_model(out_dir, num_labels=1):
    """A tiny random Qwen2 sequence-classification model saved by transformers."""
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        pad_token_id=0,
        tie_word_embeddings=False,
        num_labels=num_labels,
    )
    torch.manual_seed(11)
    model = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """(hf_dir, work dir with seqs.json, transformers' per-token scores of each sequence)."""
    from transformers import AutoModelForSequenceClassification

    root = tmp_path_factory.mktemp("score_critic")
    hf_dir = root / "rm"
    save_reward_model(hf_dir)
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(1, 96, (n,), generator=g) for n in SEQ_LENS]
    scores = []
    with torch.no_grad():
        for ids in seqs:
            hidden = model.model(ids[None]).last_hidden_state
            per_token = model.score(hidden)[0, :, 0]
            pooled = model(ids[None]).logits[0, 0]  # the last token's score
            assert torch.allclose(pooled, per_token[-1], atol=1e-6)
            scores.append(per_token)
    work = root / "work"
    work.mkdir()
    (work / "seqs.json").write_text(json.dumps([s.tolist() for s in seqs]))
    return hf_dir, work, scores


def _launch(world, hf_dir, work):
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    ranks = run_ranks(
        [worker_cmd(WORKER, r, world, port, hf_dir, work) for r in range(world)],
        timeout=240,
        env=env,
    )
    return rank_results([work / f"tp{world}.{r}.json" for r in range(world)], ranks)


def _max_diff(values, scores):
    return max(float((torch.tensor(v) - s).abs().max()) for v, s in zip(values, scores))


def test_score_model_critic_values_equal_transformers_at_tp1_and_tp2(reward_model):
    hf_dir, work, scores = reward_model
    assert min(float(s.abs().max()) for s in scores) > 0.05  # not trivially near zero
    (tp1,) = _launch(1, hf_dir, work)  # converts, then TP1
    diff1 = _max_diff(tp1["values"], scores)
    tp2 = _launch(2, hf_dir, work)
    diffs2 = [_max_diff(r["values"], scores) for r in tp2]
    print(f"max |critic - transformers|: TP1 {diff1:.3g}, TP2 {max(diffs2):.3g}")
    assert diff1 < TOL and max(diffs2) < TOL, (diff1, diffs2)


def test_bad_value_models_get_one_clear_error(tmp_path):
    two = tmp_path / "two_labels"
    save_reward_model(two, num_labels=2)
    with pytest.raises(UnsupportedModelError, match=r"num_labels=2.*needs num_labels=1"):
        convert_hf_to_mcore(two, tmp_path / "out", value_model=True, progress=False)
    gae = ["algorithm.adv_estimator=gae", "critic.enabled=true"]
    with pytest.raises(ConfigError, match=r"critic\.path=.*num_labels=2.*num_labels=1"):
        check_against_model(load_config(None, gae + [f"critic.path={two}"]))
    with pytest.raises(UnsupportedModelError, match=r"no config.json \(not an HF model"):
        convert_hf_to_mcore(tmp_path, tmp_path / "out", value_model=True, progress=False)
    assert not (tmp_path / "out").exists()


def test_actor_conversion_stays_strict(tmp_path):
    """An LM conversion refuses a sequence-classification model and an LM checkpoint with a
    stray ``score.weight`` (both fail before any process group exists)."""
    from safetensors.torch import load_file, save_file

    from areal_mega.models.tiny import make_tiny_model

    rm = tmp_path / "rm"
    save_reward_model(rm)
    with pytest.raises(UnsupportedModelError, match="Qwen2ForSequenceClassification"):
        convert_hf_to_mcore(rm, tmp_path / "out", progress=False)
    lm = make_tiny_model(tmp_path / "lm", arch="llama")
    f = lm / "model.safetensors"
    tensors = load_file(f)
    save_file(dict(tensors, **{"score.weight": torch.zeros(1, 64)}), f, metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match=r"unexpected tensor 'score\.weight'"):
        convert_hf_to_mcore(lm, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_value_model_config_rules():
    """transformers' num_labels: id2label's size, else num_labels, else 2; a value model is
    the family's causal LM or its one-label sequence classifier."""
    from areal_mega.checkpoint.value_model import hf_num_labels, value_model_problem

    assert hf_num_labels({}) == 2 and hf_num_labels({"num_labels": 1}) == 1
    assert hf_num_labels({"id2label": {"0": "LABEL_0"}, "num_labels": 3}) == 1
    lm = ("LlamaForCausalLM",)
    one = {
        "model_type": "llama",
        "architectures": ["LlamaForSequenceClassification"],
        "id2label": {"0": "LABEL_0"},
    }
    assert value_model_problem(one, lm) is None
    assert value_model_problem({"architectures": ["LlamaForCausalLM"]}, lm) is None
    assert "num_labels=2" in value_model_problem(dict(one, id2label=None), lm)
    assert "Qwen2ForSequenceClassification" in value_model_problem(
        dict(one, architectures=["Qwen2ForSequenceClassification"]), lm
    )
