"""Multi-task data: data.sources parsing and errors, weighted draws that resume exactly,
per-source rewards and plot curves, and HF datasets (built locally, no downloads)."""

import json

import numpy as np
import pytest

from areal_mega.config import ConfigError, load_config
from areal_mega.data.dataset import DataError, PromptDataset
from areal_mega.data.hf import is_hf_source, parse_hf_spec
from areal_mega.data.sources import (
    MultiSourceCursor,
    SourceSpec,
    resolve_sources,
    source_counts,
    source_schedule,
)
from areal_mega.dataplane import Trajectory
from areal_mega.models.tiny import build_char_tokenizer
from areal_mega.tracking.metrics import plot_metrics, source_reward_keys
from areal_mega.train.batches import per_source_rewards


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("ascii")


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _sources(*items):
    return "data.sources=" + json.dumps(list(items))


def test_sources_config_parses_and_errors_name_the_entry():
    cfg = load_config(
        None,
        [
            _sources(
                {"name": "add", "path": "a.jsonl", "weight": 3},
                {
                    "name": "code",
                    "path": "hf:o/n:cfg@test",
                    "reward_fn": "areal_mega.rewards:code_reward",
                    "reward_kwargs": {"all_or_nothing": True},
                    "fields": {"prompt": "question"},
                },
            )
        ],
    )
    specs = resolve_sources(cfg.data, cfg.rollout.reward_fn)
    assert [s.name for s in specs] == ["add", "code"] and specs[0].weight == 3.0
    assert specs[0].reward_fn == cfg.rollout.reward_fn  # default reward
    assert specs[1].prompt_key == "question" and specs[1].answer_key == "answer"
    assert specs[1].reward_kwargs == {"all_or_nothing": True}
    bad = [
        (
            [_sources({"name": "a", "path": "x"}, {"name": "b", "path": "y", "weight": 0})],
            r"data.sources\[1\].weight=0.0: must be > 0.0",
        ),
        (
            [_sources({"name": "a", "path": "x"}, {"name": "b", "path": "y", "wieght": 2})],
            r"data.sources\[1\].wieght: unknown key",
        ),
        (
            [_sources({"name": "a", "path": "x"}, {"name": "a", "path": "y"})],
            r"data.sources\[1\].name='a': already used by data.sources\[0\]",
        ),
        ([_sources({"name": "a", "path": "x"}), "data.train_path=t.jsonl"], "both set"),
        ([_sources({"name": "a", "path": ""})], r"data.sources\[0\].path is empty"),
        ([_sources({"name": "mean", "path": "x"})], "reserved"),
        (
            [_sources({"name": "a", "path": "x", "fields": {"promt": "q"}})],
            r"data.sources\[0\].fields.promt: unknown key",
        ),
        (["data.sources=[1, 2]"], r"data.sources\[0\]=1: expected DataSourceConfig"),
        (["data.fields={prompt: 3}"], r"data.fields.prompt=3"),
    ]
    for overrides, pattern in bad:
        with pytest.raises(ConfigError, match=pattern):
            load_config(None, overrides)


def test_weighted_schedule_is_pure_and_follows_the_weights():
    sched = source_schedule([3, 1], seed=5, start=0, count=4000)
    assert sched == source_schedule([3, 1], seed=5, start=0, count=4000)
    assert sched[1500:2600] == source_schedule([3, 1], seed=5, start=1500, count=1100)
    share = sched.count(0) / len(sched)
    assert 0.72 < share < 0.78, share
    assert source_counts([3, 1], 5, 2500) == [sched[:2500].count(0), sched[:2500].count(1)]
    assert source_schedule([3, 1], seed=6, start=0, count=50) != sched[:50]


def _cursor(tmp_path, tok, start):
    a = _jsonl(
        tmp_path / "a.jsonl", [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(7)]
    )
    b = _jsonl(
        tmp_path / "b.jsonl", [{"prompt": f"{i}*2=", "answer": str(2 * i)} for i in range(5)]
    )
    specs = [SourceSpec("add", a, 2.0), SourceSpec("mul", b, 1.0)]
    ds = [PromptDataset(s.path, tok, apply_chat_template=False) for s in specs]
    return MultiSourceCursor(ds, specs, seed=3, start=start)


def test_multi_source_cursor_resumes_exactly(tmp_path, tok):
    it = iter(_cursor(tmp_path, tok, 0))
    full = [next(it) for _ in range(2300)]  # crosses block and epoch boundaries
    assert {x["source"] for x in full} == {"add", "mul"}
    assert [x["prompt_index"] for x in full] == list(range(2300))
    for start in (1, 1024, 1700):
        resumed = iter(_cursor(tmp_path, tok, start))
        again = [next(resumed) for _ in range(2300 - start)]
        assert [(x["source"], x["prompt"]) for x in again] == [
            (x["source"], x["prompt"]) for x in full[start:]
        ]
    # every source walks its whole epoch before repeating a prompt
    adds = [x["prompt"] for x in full if x["source"] == "add"][:7]
    assert sorted(adds) == sorted(f"{i}+1=" for i in range(7))
    cur = _cursor(tmp_path, tok, 0)
    items = [cur.next_item() for _ in range(3)]
    assert cur.delivered(items[1]["prompt_index"]) == 0
    assert cur.delivered(items[0]["prompt_index"]) == 2
    # the exact resume (rollout/resume.py) rebuilds single draws with ``at``
    for k in (5, 1030):
        assert [(x["source"], x["prompt"]) for x in [next(iter(cur.at(k)))]] == [
            (full[k]["source"], full[k]["prompt"])
        ]


def _traj(source, reward):
    t = Trajectory(
        input_ids=np.zeros(3, np.int32),
        loss_mask=np.array([0, 1, 1], np.uint8),
        logprobs=np.zeros(3, np.float32),
        versions=np.array([-1, 0, 0], np.int32),
        reward=reward,
        sample_id=f"{source}{reward}",
        group_id="g",
        prompt_len=1,
        finish_reason="stop",
    )
    if source:
        t.meta["source"] = source
    return t


def test_per_source_rewards_and_plot(tmp_path):
    stats = per_source_rewards(
        [_traj("add", 1.0), _traj("add", 0.0), _traj("code", 0.25), _traj(None, 1.0)]
    )
    assert stats == {"reward/add": 0.5, "reward/code": 0.25}
    recs = [
        {
            "step": i,
            "reward/mean": 0.1 * i,
            "reward/std": 0.1,
            "reward/add": 0.2 * i,
            **({"reward/code": 0.05 * i} if i % 2 else {}),
        }
        for i in range(1, 9)
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert source_reward_keys(recs) == ["reward/add", "reward/code"]
    png = plot_metrics(path, tmp_path / "reward.png")
    assert png.stat().st_size > 1000


def test_hf_saved_dataset_with_field_mapping(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    rows = {"question": ["1+1=", "2+2=", "3+3="], "solution": ["so 2\n#### 2", "#### 4", "#### 6"]}
    one = tmp_path / "one"
    datasets.Dataset.from_dict(rows).save_to_disk(str(one))
    both = tmp_path / "dict"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict(rows),
            "test": datasets.Dataset.from_dict({k: v[:1] for k, v in rows.items()}),
        }
    ).save_to_disk(str(both))
    assert is_hf_source(str(one)) and is_hf_source(f"{both}@test")
    assert not is_hf_source(str(tmp_path))
    cfg = load_config(
        None,
        [
            _sources(
                {
                    "name": "gsm",
                    "path": str(one),
                    "reward_fn": "areal_mega.rewards:gsm8k_reward",
                    "fields": {"prompt": "question", "answer": "solution"},
                }
            )
        ],
    )
    spec = resolve_sources(cfg.data, cfg.rollout.reward_fn)[0]
    ds = PromptDataset(
        spec.path,
        tok,
        prompt_key=spec.prompt_key,
        answer_key=spec.answer_key,
        apply_chat_template=False,
    )
    assert [it.prompt for it in ds] == rows["question"] and ds[0].answer == "so 2\n#### 2"
    assert [
        it.prompt
        for it in PromptDataset(
            f"{both}@test",
            tok,
            prompt_key="question",
            answer_key="solution",
            apply_chat_template=False,
        )
    ] == ["1+1="]
    assert (
        len(
            PromptDataset(
                str(both),
                tok,
                prompt_key="question",
                answer_key="solution",
                apply_chat_template=False,
            )
        )
        == 3
    )  # default split: train
    with pytest.raises(DataError, match="no split 'valid'"):
        PromptDataset(f"{both}@valid", tok, prompt_key="question", answer_key="solution")
    with pytest.raises(DataError, match=r"missing field 'prompt'"):
        PromptDataset(str(one), tok, apply_chat_template=False)
    cfg1 = load_config(
        None,
        [
            f"data.train_path={one}",
            "data.fields={prompt: question, answer: solution}",
            "data.apply_chat_template=false",
        ],
    )
    assert len(PromptDataset.from_config(cfg1.data, tok)) == 3


def test_hf_hub_spec_parsing():
    assert parse_hf_spec("hf:openai/gsm8k:main@test") == ("openai/gsm8k", "main", "test")
    assert parse_hf_spec("hf:owner/name") == ("owner/name", None, "train")
    with pytest.raises(DataError, match="missing the dataset name"):
        parse_hf_spec("hf::main@test")
