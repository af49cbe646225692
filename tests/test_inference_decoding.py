"""The CPU server's batched decoder in process (no HTTP): a pause that lands while a request is
being admitted still aborts it, so no token decoded after a weight load carries the old
version (seen as a flaky `test_interrupted_generation_is_stitched` on a loaded machine)."""

import threading

import pytest

from areal_mega.inference.decoding import BatchedEngine, GenRequest
from areal_mega.inference.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)


def _request(rid: str, done: threading.Event) -> GenRequest:
    return GenRequest(
        rid=rid,
        input_ids=[5, 6, 7, 8],
        on_done=lambda r: done.set(),
        params=SamplingParams(max_new_tokens=10_000, ignore_eos=True),
    )


@pytest.fixture
def engine(models):
    eng = BatchedEngine(models["ma"], eos_token_id=None, max_running=8)
    try:
        yield eng
    finally:
        eng.shutdown()


def _hold_prefill(engine):
    """Make the engine thread wait inside its next prefill until ``release`` is set; returns
    ``(entered, release)``. The real prefill runs afterwards."""
    entered, release = threading.Event(), threading.Event()
    real = engine._batch.prefill

    def held(ids, prefix=None):
        entered.set()
        assert release.wait(30)
        engine._batch.prefill = real
        return real(ids, prefix)

    engine._batch.prefill = held
    return entered, release


def test_pause_during_admission_aborts_the_request(engine):
    entered, release = _hold_prefill(engine)
    done = threading.Event()
    req = _request("r0", done)
    engine.submit(req)
    assert entered.wait(30)  # taken off the queue, inside prefill, not yet running
    engine.pause()
    release.set()
    engine.run_exclusive(lambda: None, timeout=30)  # what /pause_generation waits for
    assert done.is_set() and req.finish_reason["type"] == "abort", req.finish_reason
    assert len(req.output_ids) <= 1 and req.weight_version == "0"
    n_before = engine.tokens_generated
    engine.run_exclusive(lambda: setattr(engine, "weight_version", "1"), timeout=30)
    engine.run_exclusive(lambda: None, timeout=30)
    assert engine.num_running == 0 and engine.tokens_generated == n_before


def test_abort_by_rid_during_admission(engine):
    entered, release = _hold_prefill(engine)
    done = threading.Event()
    req = _request("r1", done)
    engine.submit(req)
    assert entered.wait(30)
    assert engine.abort("r1") == 1
    release.set()
    assert done.wait(30) and req.finish_reason["type"] == "abort"
    engine.run_exclusive(lambda: None, timeout=30)
    assert engine.num_running == 0
