"""Teacher scoring: SGLang's ``/generate`` with ``max_new_tokens: 0``, ``return_logprob`` and
``logprob_start_len`` on the real CPU server process, and the client-side scorer."""

import numpy as np
import pytest

from areal_mega.inference.process import launch_local_servers
from areal_mega.rollout.client import RolloutClient
from areal_mega.rollout.scoring import ScoringError, TeacherServerScorer, score_sequences
from tests.helpers.rollout import API_KEY, http, run, teacher_forced_logprobs

pytestmark = pytest.mark.timeout(300)

SEQS = [[5, 9, 13, 2, 7, 7, 30, 4], [11, 3, 3, 8, 21, 6], [40, 1, 2, 3, 4, 5, 6, 7, 8, 9], [17, 18]]


def post(server, body: dict):
    return http(server, "/generate", body)


def score_body(ids, start, **extra):
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "logprob_start_len": start,
        **extra,
    }


def test_input_logprobs_equal_teacher_forcing_single(server, models):
    """One sequence at several starts: entry 0 is None, entry t-k is log p(ids[t] | ids[:t])."""
    for ids in SEQS[:3]:
        for k in (0, 1, 3, len(ids) - 2):
            status, out = post(server, score_body(ids, k))
            assert status == 200, out
            entries = out["meta_info"]["input_token_logprobs"]
            assert entries[0][0] is None
            want = teacher_forced_logprobs(models["ma"], ids, k + 1)
            got = [e[0] for e in entries[1:]]
            assert len(got) == len(want) == len(ids) - k - 1
            assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5


def test_input_logprobs_equal_teacher_forcing_batched(server, models):
    """A batch of sequences (two of equal length share a forward) with one start each."""
    seqs = SEQS + [[5, 9, 13, 2, 7, 7, 30, 3]]
    starts = [0, 2, 5, 0, 4]
    status, out = post(server, score_body(seqs, starts))
    assert status == 200 and isinstance(out, list) and len(out) == len(seqs)
    for ids, k, o in zip(seqs, starts, out):
        entries = o["meta_info"]["input_token_logprobs"]
        want = teacher_forced_logprobs(models["ma"], ids, k + 1)
        got = [e[0] for e in entries[1:]]
        assert len(got) == len(want)
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5


def test_input_logprobs_are_at_temperature_one(server, models):
    """SGLang never scales input logprobs by the request's temperature."""
    ids = SEQS[0]
    body = score_body(ids, 0)
    body["sampling_params"]["temperature"] = 0.5
    status, out = post(server, body)
    assert status == 200
    got = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
    want = teacher_forced_logprobs(models["ma"], ids, 1)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-5


def test_sglang_answer_shape(server):
    """Token ids echoed from position k on, first value None, no output, finish length 0;
    text only with return_text_in_logprobs; the default start gives one None entry."""
    ids = SEQS[1]
    status, out = post(server, score_body(ids, 0))
    assert status == 200
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids and entries[0][0] is None
    assert all(e[2] is None for e in entries)
    assert all(isinstance(e[0], float) for e in entries[1:])
    assert out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert out["meta_info"]["completion_tokens"] == 0
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    status, out = post(server, score_body(ids, 2, return_text_in_logprobs=True))
    assert status == 200
    entries = out["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[2:] and len(entries) == len(ids) - 2
    assert all(isinstance(e[2], str) for e in entries)
    body = score_body(ids, -1)
    status, out = post(server, body)
    assert status == 200
    assert out["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]
    del body["logprob_start_len"]
    assert post(server, body)[1]["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]


def test_input_logprobs_with_generation(server, models):
    """max_new_tokens > 0: output tokens and logprobs as usual plus the input logprobs."""
    ids = SEQS[2]
    body = score_body(ids, 1)
    body["sampling_params"] = {"max_new_tokens": 4, "ignore_eos": True}
    status, out = post(server, body)
    assert status == 200 and len(out["output_ids"]) == 4
    assert len(out["meta_info"]["output_token_logprobs"]) == 4
    got = [e[0] for e in out["meta_info"]["input_token_logprobs"][1:]]
    want = teacher_forced_logprobs(models["ma"], ids, 2)
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5
    full = ids + out["output_ids"]
    out_want = teacher_forced_logprobs(models["ma"], full, len(ids))
    out_got = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(out_got, out_want)) <= 1e-4


@pytest.mark.parametrize(
    "bad, needle",
    [
        (-2, "logprob_start_len=-2"),
        (6, "logprob_start_len=6"),
        (100, "logprob_start_len=100"),
        ("3", "logprob_start_len"),
        ([0, 1], "logprob_start_len"),
        (True, "logprob_start_len"),
    ],
)
def test_bad_logprob_start_len_is_400(server, bad, needle):
    """Out-of-range or mistyped logprob_start_len: 400 naming the field; the server serves on."""
    status, out = post(server, score_body(SEQS[1], bad))
    assert status == 400 and needle in out["error"]["message"]
    assert post(server, score_body(SEQS[1], 0))[0] == 200


def test_input_top_logprobs_are_refused(server):
    """Input positions together with top_logprobs_num are not implemented: 400 naming both."""
    status, out = post(server, score_body(SEQS[1], 0, top_logprobs_num=2))
    assert status == 400
    assert "logprob_start_len" in out["error"]["message"]
    assert "top_logprobs_num" in out["error"]["message"]


def test_score_sequences_checks_starts_and_names_the_sequence(server):
    """A start outside [1, len] is refused before any request, naming the sequence index."""

    async def go():
        c = RolloutClient([server.addr], api_key=API_KEY, timeout_s=60, retries=1)
        try:
            with pytest.raises(ValueError, match="sequence 1"):
                await score_sequences(c, SEQS[:2], [1, 0])
            with pytest.raises(ValueError, match="sequence 0"):
                await score_sequences(c, SEQS[:1], [len(SEQS[0]) + 1])
            return await score_sequences(c, SEQS[:2], [len(SEQS[0]), 3])
        finally:
            await c.close()

    out = run(go())
    assert out[0] == [] and len(out[1]) == len(SEQS[1]) - 3


def test_score_sequences_names_server_on_refusal(server):
    """A 4xx from the server raises ScoringError naming the server and the sequences."""

    async def go():
        c = RolloutClient([server.addr], api_key="wrong", timeout_s=60, retries=1)
        try:
            await score_sequences(c, SEQS[:2], [1, 1])
        finally:
            await c.close()

    with pytest.raises(ScoringError, match=f"{server.addr}.*sequences 0..1"):
        run(go())


def test_teacher_scorer_on_two_servers_equals_teacher_forcing(server, models):
    """TeacherServerScorer over two server processes (the module's and one more): every
    batch, whichever server scored it, equals teacher forcing within 1e-5; float32 arrays of
    the right lengths."""
    procs = launch_local_servers(str(models["a"]), 1, api_key=API_KEY)
    try:
        seqs = [SEQS[i % len(SEQS)][: 2 + i % 7] + [i + 3] for i in range(20)]
        starts = [1 + i % (len(s) - 1) for i, s in enumerate(seqs)]
        scorer = TeacherServerScorer(
            [server.addr, procs[0].addr], api_key=API_KEY, timeout_s=60, batch=3
        )
        try:
            got = scorer.score(seqs, starts)
            assert scorer.score([], []) == []
        finally:
            scorer.close()
        assert len(got) == len(seqs)
        for s, k, g in zip(seqs, starts, got):
            assert isinstance(g, np.ndarray) and g.dtype == np.float32
            want = np.asarray(teacher_forced_logprobs(models["ma"], s, k), dtype=np.float64)
            assert g.shape == (len(s) - k,)
            assert np.max(np.abs(g.astype(np.float64) - want)) <= 1e-5
        with pytest.raises(RuntimeError, match="closed"):
            scorer.score(seqs[:1], starts[:1])
    finally:
        for p in procs:
            p.stop()


def test_teacher_scorer_skips_a_dead_server(server, models):
    """A member that cannot be reached is marked down and its batches go to the other."""
    dead = "127.0.0.1:9"  # discard port: nothing listens
    scorer = TeacherServerScorer([dead, server.addr], api_key=API_KEY, timeout_s=30, batch=1)
    try:
        got = scorer.score(SEQS, [1] * len(SEQS))
        assert not scorer.client.is_healthy(dead)
    finally:
        scorer.close()
    for s, g in zip(SEQS, got):
        want = teacher_forced_logprobs(models["ma"], s, 1)
        assert np.max(np.abs(g - np.asarray(want))) <= 1e-5


def test_scorer_is_usable_from_plain_sync_code_repeatedly(server, models):
    """Several score calls on one scorer (its loop thread stays up between them)."""
    scorer = TeacherServerScorer([server.addr], api_key=API_KEY, timeout_s=60)
    try:
        for k in (1, 2, 3):
            got = scorer.score(SEQS[:2], [k, k])
            for s, g in zip(SEQS[:2], got):
                want = teacher_forced_logprobs(models["ma"], s, k)
                assert np.max(np.abs(g - np.asarray(want))) <= 1e-5
    finally:
        scorer.close()
    scorer.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(SEQS[:1], [1])
