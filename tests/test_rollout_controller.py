"""RolloutController against real CPU server processes, driven through the API the rollout
worker uses (groups into a sink, weight updates with pause/resume): interruptible weight
updates, the staleness bound, a server dying mid-run, multi-turn episodes, delivery order and
failures surfacing."""

import json
import time
import urllib.request

import numpy as np
import pytest

from areal_mega.inference.process import launch_local_servers
from areal_mega.rewards import exact_match_reward
from areal_mega.rollout.client import RolloutClient
from areal_mega.rollout.controller import RolloutController
from areal_mega.rollout.staleness import sample_version
from areal_mega.workflow.builtin import MultiTurnWorkflow, RetryEnvironment, RLVRWorkflow
from tests.helpers.rollout import API_KEY, GroupSink, run, teacher_forced_logprobs

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def servers(models):
    procs = launch_local_servers(str(models["a"]), 2, api_key=API_KEY)
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def prompts(n, length=4):
    return [
        {
            "input_ids": [5 + (i % 50)] + [6 + (i * 7 + j) % 60 for j in range(length - 1)],
            "answer": "never",
        }
        for i in range(n)
    ]


def make_controller(
    addrs,
    *,
    batch_size,
    n_samples,
    eta,
    max_new_tokens,
    sink,
    n_prompts=64,
    workflow=None,
    tokenizer=None,
    **kw,
):
    client = RolloutClient(addrs, api_key=API_KEY, timeout_s=120, retries=4, backoff_s=0.05)
    wf = workflow or RLVRWorkflow(exact_match_reward, max_new_tokens)
    return RolloutController(
        client,
        wf,
        prompts(n_prompts),
        batch_size=batch_size,
        n_samples=n_samples,
        eta=eta,
        sink=sink,
        tokenizer=tokenizer,
        ignore_eos=True,
        **kw,
    )


def wait_for(cond, timeout=60):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def tokens_generated(addrs) -> int:
    """Decode tokens produced so far, summed over the servers' /get_server_info."""
    total = 0
    for a in addrs:
        req = urllib.request.Request(
            f"http://{a}/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            total += json.load(r)["tokens_generated"]
    return total


def load_weights(addrs, path, version=0):
    """Load ``path`` on every server from a client of its own, as the trainer's side of a
    begin_update/end_update pair does (and as the end of a test restores model a)."""

    async def go():
        c = RolloutClient(addrs, api_key=API_KEY)
        try:
            await c.update_weights_from_disk(str(path), weight_version=version)
        finally:
            await c.close()

    run(go())


N_NEW = 480  # new tokens per request: prompt (4) + 480 fits the tiny models' 512 positions


def test_interrupted_generation_is_stitched(servers, models):
    """Pause mid-generation, load new weights, continue: every sample completes, its versions
    switch 0 -> 1 exactly where it was interrupted, and each token's logprob is the teacher-
    forced logprob of the model version that produced it."""
    addrs = [p.addr for p in servers]
    base = tokens_generated(addrs)
    sink = GroupSink()
    ctl = make_controller(
        addrs, batch_size=4, n_samples=2, eta=1, max_new_tokens=N_NEW, sink=sink
    ).start()
    try:
        # interrupt once every in-flight request is a few tokens in: 8 requests x 4 tokens. The
        # pause must land before they finish; in one CI run on a loaded 2-core machine all of
        # them finished 120 tokens first, hence the long generations.
        wait_for(lambda: ctl.n_inflight_requests >= 8)
        wait_for(lambda: tokens_generated(addrs) - base >= 32, timeout=120)
        ctl.update_weights(1, path=str(models["b"]))
        groups = sink.take(ctl, 8, timeout=120)
    finally:
        ctl.stop()
        load_weights(addrs, models["a"])
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 16
    n_interrupted = 0
    for t in trajs:
        P = t.prompt_len
        assert t.finish_reason == "length" and len(t.input_ids) == P + N_NEW
        assert (t.versions[:P] == -1).all() and (t.loss_mask[:P] == 0).all()
        assert (t.loss_mask[P:] == 1).all() and (t.logprobs[:P] == 0).all()
        gen_v = t.versions[P:]
        assert set(gen_v.tolist()) <= {0, 1} and (np.diff(gen_v) >= 0).all()
        k = int((gen_v == 0).sum())  # the interruption point
        ids = t.input_ids.tolist()
        if 0 < k < N_NEW:
            n_interrupted += 1
            assert t.meta["n_interruptions"] == 1
        lp_a = teacher_forced_logprobs(models["ma"], ids, P)[:k]
        lp_b = teacher_forced_logprobs(models["mb"], ids, P)[k:]
        assert np.abs(np.array(lp_a + lp_b) - t.logprobs[P:]).max() <= 1e-4
    assert n_interrupted >= 4
    assert ctl.stats()["interruptions"] >= n_interrupted


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_staleness_bound(servers, models, eta):
    """No consumed sample is older than trainer version - eta; with eta > 0 the bound is
    reached (groups started at version 0 are consumed up to eta versions later). The trainer
    consumes B groups per step in arrival order and pushes its weights between
    begin_weight_update and end_weight_update, as over the worker's control channel."""
    B, steps = 2, 4
    addrs = [p.addr for p in servers]
    sink = GroupSink()
    ctl = make_controller(
        addrs, batch_size=B, n_samples=2, eta=eta, max_new_tokens=6, sink=sink
    ).start()
    worst = 0
    try:
        for step in range(steps):
            groups = sink.take(ctl, B, timeout=60)
            assert len(groups) == B
            st = ctl.stats()
            assert st["started"] - st["failed"] <= (eta + ctl.version + 1) * B
            for g in groups:
                for t in g:
                    v = sample_version(t.versions)
                    assert v >= ctl.version - eta, (v, ctl.version, eta)
                    worst = max(worst, ctl.version - v)
            ctl.begin_weight_update()
            load_weights(addrs, models["a"], step + 1)
            ctl.end_weight_update(step + 1)
            assert ctl.version == step + 1
    finally:
        ctl.stop()
    assert worst == min(eta, steps - 1)


def test_killing_one_server_loses_nothing(models):
    procs = launch_local_servers(str(models["a"]), 2, api_key=API_KEY)
    try:
        # long requests and an early kill: none can finish on server 0 before it dies, so
        # every trajectory must have been completed (or resumed) on server 1
        sink = GroupSink()
        ctl = make_controller(
            [p.addr for p in procs], batch_size=4, n_samples=2, eta=0, max_new_tokens=300, sink=sink
        ).start()
        try:
            wait_for(lambda: ctl.n_inflight_requests >= 8)
            time.sleep(0.05)
            procs[0].kill()
            groups = sink.take(ctl, 4, timeout=120)
            st = ctl.stats()
        finally:
            ctl.stop()
        trajs = [t for g in groups for t in g]
        assert len(trajs) == 8 and st["failed"] == 0
        assert all(len(t.input_ids) == t.prompt_len + 300 for t in trajs)
        assert {t.server_id for t in trajs} == {"http://" + procs[1].addr}
        assert ctl.client.live_servers() == ["http://" + procs[1].addr]
        for t in trajs[:3]:  # what the surviving server produced is still exact
            ids = t.input_ids.tolist()
            ref = teacher_forced_logprobs(models["ma"], ids, t.prompt_len)
            assert np.abs(np.array(ref) - t.logprobs[t.prompt_len :]).max() <= 1e-4
    finally:
        for p in procs:
            p.stop()


def test_multi_turn_environment_tokens_masked_and_sink(servers, models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["a"])
    feedback = "\nWrong, try again:\n"
    wf = MultiTurnWorkflow(
        lambda: RetryEnvironment(exact_match_reward, feedback=feedback),
        max_new_tokens=6,
        max_turns=3,
        max_total_tokens=200,
    )
    sink = GroupSink()
    ctl = make_controller(
        [p.addr for p in servers],
        batch_size=2,
        n_samples=2,
        eta=0,
        max_new_tokens=6,
        workflow=wf,
        sink=sink,
        tokenizer=tok,
        n_prompts=2,
    ).start()
    try:
        got = sink.take(ctl, 2)
        assert ctl.stats()["accepted"] == 2
    finally:
        ctl.stop()
    assert len(sink) == 2  # two prompts: nothing else was delivered
    fb = tok(feedback, add_special_tokens=False)["input_ids"]
    for t in [t for g in got for t in g]:
        P = t.prompt_len
        assert t.meta["turns"] == 3 and t.reward == 0.0
        mask = t.loss_mask[P:].tolist()
        assert mask == [1] * 6 + [0] * len(fb) + [1] * 6 + [0] * len(fb) + [1] * 6
        env = t.loss_mask == 0
        assert (t.versions[env] == -1).all() and (t.logprobs[env] == 0).all()
        assert t.input_ids[P + 6 : P + 6 + len(fb)].tolist() == fb
        ids = t.input_ids.tolist()
        ref = np.array(teacher_forced_logprobs(models["ma"], ids, P))
        gen = t.loss_mask[P:] == 1
        assert np.abs(ref[gen] - t.logprobs[P:][gen]).max() <= 1e-4


class _OutOfOrderWorkflow:
    """Every third group finishes late, and group 2 fails once (retried under a new index)."""

    def __init__(self, inner):
        self.inner = inner
        self.failed = False

    async def arun_episode(self, ctx, item, n_samples):
        import asyncio

        if ctx.group_index == 2 and not self.failed:
            self.failed = True
            raise RuntimeError("injected episode failure")
        out = await self.inner.arun_episode(ctx, item, n_samples)
        if ctx.group_index % 3 == 0:
            await asyncio.sleep(0.4)
        return out


def test_sink_receives_groups_in_start_order(servers):
    """With a sink, a finished group waits for every earlier-started group (a failed one is
    skipped, not waited for): the trainer then consumes in start order, which is what makes the
    staleness bound exact on the data-plane path."""
    sink = GroupSink()
    wf = _OutOfOrderWorkflow(RLVRWorkflow(exact_match_reward, 4))
    ctl = make_controller(
        [p.addr for p in servers],
        batch_size=3,
        n_samples=2,
        eta=1,
        max_new_tokens=4,
        workflow=wf,
        sink=sink,
        n_prompts=12,
    ).start()
    try:
        wait_for(lambda: len(sink) >= 5, timeout=120)
    finally:
        ctl.stop()
    got = [g[0].meta["group_index"] for g in sink.groups]
    assert got == sorted(got) and 2 not in got, got  # start order; the failed index skipped
    assert ctl.stats()["failed"] == 1


class _FailingWorkflow:
    async def arun_episode(self, ctx, item, n_samples):
        raise RuntimeError("injected episode failure")


def _failing_sink(group):
    raise ValueError("injected sink failure")


@pytest.mark.parametrize("case", ["episode", "sink", "unreachable"])
def test_failure_surfaces_through_raise_if_failed(servers, case):
    """What the worker polls: an episode failing on every retry (each retry counted), a sink
    raising, or no server reachable makes ``raise_if_failed`` raise with the cause chained."""
    addrs, wf, sink = [p.addr for p in servers], None, GroupSink()
    if case == "episode":
        wf, match = _FailingWorkflow(), "episode failed 2 times: injected episode failure"
    elif case == "sink":
        sink, match = _failing_sink, "injected sink failure"
    else:
        addrs, match = ["127.0.0.1:9"], "no healthy rollout server"
    ctl = make_controller(
        addrs,
        batch_size=1,
        n_samples=1,
        eta=0,
        max_new_tokens=2,
        workflow=wf,
        sink=sink,
        n_prompts=1,
        max_episode_retries=2,
    ).start()
    try:

        def failed():
            try:
                ctl.raise_if_failed()
            except RuntimeError as e:
                return e

        wait_for(failed, timeout=120)
        e = failed()
    finally:
        ctl.stop()
    assert str(e).startswith("rollout failed: ") and match in str(e)
    assert e.__cause__ is not None and match in str(e.__cause__)
    if case == "episode":
        assert ctl.stats()["failed"] == 2 and ctl.stats()["started"] == 2 and len(sink) == 0


def _seeded_run(addrs, seed):
    """Tokens of the first 4 groups (by group index) of a controller seeded with ``seed``."""
    sink = GroupSink()
    ctl = make_controller(
        addrs,
        batch_size=2,
        n_samples=3,
        eta=1,
        max_new_tokens=8,
        sink=sink,
        n_prompts=4,
        temperature=1.0,
        sampling_seed=seed,
    ).start()
    try:
        groups = sink.take(ctl, 4, timeout=120)
    finally:
        ctl.stop()
    return {
        (g[0].meta["group_index"], t.sample_id.rsplit("-", 1)[1]): t.input_ids.tolist()
        for g in groups
        for t in g
    }


def test_seeded_sampling_samples_the_same_tokens_again(servers):
    """``rollout.seeded_sampling``: two controllers (each its own random run id, requests
    spread over two servers in whatever order) seeded alike sample the same tokens for every
    sample of every group at temperature 1; another seed samples others. The seed is a pure
    function of the run's seed, the request key without the run id, and the segment."""
    from areal_mega.rollout.controller import request_seed

    addrs = [p.addr for p in servers]
    first, again, other = (_seeded_run(addrs, s) for s in (7, 7, 8))
    assert len(first) == 12 and first == again
    assert other.keys() == first.keys() and other != first
    assert request_seed(7, "g0-s1-t0", 0) == request_seed(7, "g0-s1-t0", 0)
    seeds = {
        request_seed(s, f"g{g}-s{j}-t0", r)
        for s in (7, 8)
        for g in range(3)
        for j in range(3)
        for r in range(2)
    }
    assert len(seeds) == 36 and all(0 <= x < 2**63 for x in seeds)
