"""Datasets: reading, chat template, length filter, errors, resumable deterministic order."""

import json

import pytest

from areal_mega.config import load_config
from areal_mega.data import DataError, PromptDataset, PromptLoader, PromptSampler, write_task_files
from areal_mega.data.synthetic import make_examples
from areal_mega.models.tiny import build_char_tokenizer
from areal_mega.rewards import exact_match_reward


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer("ascii")


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_chat_template_and_length_filter(tmp_path, tok):
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
    )
    f = _write(
        tmp_path / "d.jsonl",
        [
            {"q": "12=", "a": "21", "src": "x"},
            "",
            {"q": "9" * 50, "a": "1"},
            {"q": [{"role": "system", "content": "s"}, {"role": "user", "content": "3="}], "a": 3},
        ],
    )
    ds = PromptDataset(f, tok, prompt_key="q", answer_key="a", max_prompt_len=20)
    assert len(ds) == 2 and ds.n_dropped == 1 and ds.n_total == 3
    assert ds[0].prompt == "[user]12=>" and ds[0].answer == "21" and ds[0].meta["src"] == "x"
    assert tok.decode(ds[0].input_ids) == "[user]12=>"
    assert ds[1].prompt == "[system]s[user]3=>" and ds[1].answer == 3
    # message lists need a chat template
    with pytest.raises(DataError, match="apply_chat_template"):
        PromptDataset(f, tok, prompt_key="q", answer_key="a", apply_chat_template=False)
    f2 = _write(tmp_path / "r.jsonl", [{"prompt": "12=", "answer": "21"}])
    raw = PromptDataset(f2, tok, apply_chat_template=False)
    assert raw[0].prompt == "12=" and len(raw[0].input_ids) == 3


@pytest.mark.parametrize(
    "rows, words",
    [
        (
            [{"prompt": "a", "answer": "b"}, '{"prompt": "x", "answer": '],
            ["d.jsonl:2", "invalid JSON"],
        ),
        (
            [{"prompt": "a", "answer": "b"}, {"prompt": "c"}],
            ["d.jsonl:2", "'answer'", "data.answer_key"],
        ),
        ([{"question": "a", "answer": "b"}], ["d.jsonl:1", "'prompt'", "question"]),
        (["[1, 2]"], ["d.jsonl:1", "JSON object"]),
        ([{"prompt": 5, "answer": "b"}], ["d.jsonl:1", "string or a list"]),
    ],
)
def test_errors_name_line_and_field(tmp_path, tok, rows, words):
    f = _write(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as e:
        PromptDataset(f, tok, apply_chat_template=False)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_missing_file_and_parquet_without_pyarrow(tmp_path, tok):
    with pytest.raises(DataError, match="not found"):
        PromptDataset(tmp_path / "nope.jsonl", tok)
    pq = tmp_path / "d.parquet"
    pq.write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="pyarrow"):
            PromptDataset(pq, tok)


def test_all_dropped_is_an_error(tmp_path, tok):
    f = _write(tmp_path / "d.jsonl", [{"prompt": "x" * 30, "answer": "1"}])
    with pytest.raises(DataError, match="no usable prompts"):
        PromptDataset(f, tok, apply_chat_template=False, max_prompt_len=10)


def test_from_config(tmp_path, tok):
    train, test = write_task_files(tmp_path, "reverse", n_train=64, n_test=16, seed=3)
    cfg = load_config(
        None,
        [f"data.train_path={train}", f"data.test_path={test}", "data.apply_chat_template=false"],
    )
    ds = PromptDataset.from_config(cfg.data, tok)
    dt = PromptDataset.from_config(cfg.data, tok, split="test")
    assert len(ds) == 64 and len(dt) == 16
    assert not {i.prompt for i in ds.items} & {i.prompt for i in dt.items}
    cfg2 = load_config(None, [])
    with pytest.raises(DataError, match="data.train_path"):
        PromptDataset.from_config(cfg2.data, tok)


def test_sampler_resume_is_exact():
    full = PromptSampler(10, 3, seed=7)
    ref = [full.next_indices() for _ in range(12)]  # 4 epochs of 3 batches (drop_last)
    assert all(len(b) == 3 for b in ref)
    for b in range(4):  # every epoch is a permutation prefix; epochs differ
        ep = sum(ref[3 * b : 3 * b + 3], [])
        assert len(set(ep)) == 9
    assert ref[0:3] != ref[3:6]
    for cut in (0, 1, 3, 5, 11):
        s = PromptSampler(10, 3, seed=7)
        for _ in range(cut):
            s.next_indices()
        state = json.loads(json.dumps(s.state_dict()))  # plain JSON
        s2 = PromptSampler(10, 3, seed=7)
        s2.load_state_dict(state)
        assert [s2.next_indices() for _ in range(12 - cut)] == ref[cut:]
    other = PromptSampler(10, 3, seed=8)
    assert [other.next_indices() for _ in range(3)] != ref[:3]
    with pytest.raises(DataError, match="seed"):
        other.load_state_dict(full.state_dict())


def test_sampler_keep_last_and_no_shuffle():
    s = PromptSampler(5, 2, seed=0, shuffle=False, drop_last=False)
    assert [s.next_indices() for _ in range(4)] == [[0, 1], [2, 3], [4], [0, 1]]
    with pytest.raises(DataError, match="larger than the dataset"):
        PromptSampler(3, 4)


def test_loader_state_roundtrip(tmp_path, tok):
    train, _ = write_task_files(tmp_path, "add", n_train=20, n_test=4, seed=1)
    ds = PromptDataset(train, tok, apply_chat_template=False)
    a = PromptLoader(ds, batch_size=4, seed=5)
    first = [[i.prompt for i in b] for b in a.batches(3)]
    state = a.state_dict()
    rest = [[i.prompt for i in b] for b in a.batches(4)]
    b = PromptLoader(ds, batch_size=4, seed=5)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert [[i.prompt for i in x] for x in b.batches(4)] == rest
    assert first != rest[:3]


def test_synthetic_tasks_and_reward():
    ex = make_examples("reverse", 50, seed=0)
    assert len({e["prompt"] for e in ex}) == 50
    assert all(e["prompt"][:-1][::-1] == e["answer"] and len(e["answer"]) == 5 for e in ex)
    assert make_examples("reverse", 5, seed=0) == ex[:5]
    for e in make_examples("arith", 50, seed=1):
        expr = e["prompt"][:-1]
        assert str(eval(expr)) == e["answer"] and int(e["answer"]) >= 0
    assert exact_match_reward("48312=", "21384<eos>", "21384") == 1.0
    assert exact_match_reward("48312=", "21384", "21384", finish_reason="stop") == 1.0
    assert exact_match_reward("48312=", "21384", "21384") == 1.0
    assert exact_match_reward("48312=", "21384", "21384", finish_reason="length") == 0.0
    assert exact_match_reward("48312=", "213840<eos>", "21384") == 0.0
    assert exact_match_reward("48312=", "21384 <eos>", "21384") == 0.0
    assert exact_match_reward("1+2=", "3", 3) == 1.0
    assert exact_match_reward("48312=", None, "21384") == 0.0
    tok = build_char_tokenizer("digits")  # the demo vocabulary covers every synthetic prompt
    for task in ("reverse", "add", "arith"):
        for e in make_examples(task, 20, seed=2):
            assert tok.unk_token_id not in tok(e["prompt"] + e["answer"])["input_ids"]


def test_char_match_reward_partial_credit():
    from areal_mega.rewards import char_match_reward

    assert char_match_reward("", "21384<eos>", "21384") == 1.0
    assert char_match_reward("", "21300", "21384") == 0.6
    assert char_match_reward("", "2138444", "21384") == 5 / 7  # longer text is penalised
    assert char_match_reward("", "", "21384") == 0.0
