"""Interop with real SGLang / AReaL peers, built from their source
(tests/helpers/sglang_peer_worker.py):

- our trainer-side sender against a receiver that creates the weight-update group and receives
  buckets the way SGLang's ModelRunner does;
- an SGLang/AReaL-style trainer (AReaL's request payloads, SGLang's group creation,
  ``torch.distributed.broadcast(src=0)``) against our CPU server;
- AReaL's unmodified ``/generate`` body against our CPU server.

Gloo throughout; group timeouts are short so that an incompatible group fails fast.
"""

import concurrent.futures
import datetime
import subprocess
import time

import pytest
import torch

from areal_mega.common.net import free_port
from areal_mega.rollout.client import RolloutClient
from areal_mega.train.weight_sender import DistributedWeightSender, plan_weight_buckets
from tests.helpers.rollout import http, teacher_forced_logprobs
from tests.helpers.sglang_peer_worker import sglang_init_custom_process_group
from tests.helpers.workers import ROOT, worker_cmd, worker_env

pytestmark = pytest.mark.timeout(300)
GROUP_TIMEOUT_S = 30.0  # a group that never forms fails the test within this


def wait_http_ok(addr, path, proc, deadline_s=120):
    """Poll ``GET path`` until it answers 200 (the process must stay alive)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "peer process exited"
        try:
            if http(addr, path, key=None, timeout=2)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{addr}{path} not ready")


def test_our_sender_to_sglang_style_receiver(models, tmp_path):
    """DistributedWeightSender (connect + bucketed send) against SGLang's group creation and
    receive loop: every tensor of model B arrives bit-exact, bucket by bucket."""
    port = free_port()
    proc = subprocess.Popen(
        worker_cmd(
            "sglang_peer_worker",
            "--port",
            port,
            "--out-dir",
            tmp_path,
            "--group-timeout-s",
            GROUP_TIMEOUT_S,
        ),
        cwd=ROOT,
        env=worker_env(),
    )
    try:
        addr = f"127.0.0.1:{port}"
        wait_http_ok(addr, "/health", proc)
        named = [(n, p.detach().clone()) for n, p in models["mb"].named_parameters()]
        bucket_bytes = 40_000
        plan = plan_weight_buckets([(n, t.shape, t.dtype) for n, t in named], bucket_bytes)
        sender = DistributedWeightSender(
            RolloutClient([addr], timeout_s=60, retries=0, control_timeout_s=2 * GROUP_TIMEOUT_S),
            backend="gloo",
            group_name="interop_to_sglang",
            bucket_bytes=bucket_bytes,
            timeout_s=GROUP_TIMEOUT_S,
        )
        sender.connect()
        try:
            assert sender.send(iter(named)) == len(plan)
        finally:
            sender.close()
        got = {}
        for i in range(len(plan)):
            bucket = torch.load(tmp_path / f"bucket-{i}.pt")
            assert list(bucket) == [n for n, _, _ in plan[i]]
            got.update(bucket)
        assert list(got) == [n for n, _ in named]
        for n, t in named:
            assert got[n].dtype == t.dtype and torch.equal(got[n], t), n
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_sglang_style_sender_to_our_server(server, models):
    """A trainer doing what AReaL's does (its /init_weights_update_group payload with a string
    master_port, SGLang's group creation as rank 0, its /update_weights_from_distributed payload
    with abort_all_requests, one broadcast(src=0) per tensor) updates our server to model B."""
    port = free_port()
    group = "interop_from_sglang"
    pool = concurrent.futures.ThreadPoolExecutor(2)
    # areal/engine/sglang_remote.py SGLangBackend.build_init_weights_group_request (PP = 1)
    init = pool.submit(
        http,
        server.addr,
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": str(port),
            "rank_offset": 1,
            "world_size": 2,
            "backend": "gloo",
            "group_name": group,
        },
    )
    pg = sglang_init_custom_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
        world_size=2,
        rank=0,
        group_name=group,
    )
    try:
        status, body = init.result(timeout=GROUP_TIMEOUT_S)
        assert status == 200 and body["success"] is True, body
        named = [(n, p.detach().clone()) for n, p in models["mb"].named_parameters()]
        for bucket in plan_weight_buckets([(n, t.shape, t.dtype) for n, t in named], 60_000):
            # build_distributed_weight_update_requests
            upd = pool.submit(
                http,
                server.addr,
                "/update_weights_from_distributed",
                {
                    "names": [n for n, _, _ in bucket],
                    "dtypes": [d for _, _, d in bucket],
                    "shapes": [list(s) for _, s, _ in bucket],
                    "group_name": group,
                    "abort_all_requests": True,
                },
            )
            tensors = dict(named)
            for n, _, _ in bucket:
                torch.distributed.broadcast(tensors[n], src=0, group=pg)
            status, body = upd.result(timeout=GROUP_TIMEOUT_S)
            assert status == 200 and body["success"] is True, body
    finally:
        torch.distributed.destroy_process_group(pg)
        pool.shutdown()
    status, body = http(server.addr, "/destroy_weights_update_group", {"group_name": group})
    assert status == 200, body
    prompt = [20, 21, 22]
    status, out = http(
        server.addr,
        "/generate",
        {
            "input_ids": prompt,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 12, "ignore_eos": True},
        },
    )
    assert status == 200, out
    lps = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
    ref = teacher_forced_logprobs(models["mb"], prompt + out["output_ids"], len(prompt))
    assert max(abs(a - b) for a, b in zip(ref, lps)) <= 1e-4
    status, body = http(
        server.addr,
        "/update_weights_from_disk",
        {"model_path": str(models["a"]), "abort_all_requests": True},
    )
    assert status == 200, body


def test_areal_generate_body_is_served(server, models):
    """AReaL's unmodified /generate request (SGLangBackend.build_generation_request in
    areal/engine/sglang_remote.py, GenerationHyperparameters defaults, a stop word) gets a 200,
    and AReaL's response parsing finds what it needs."""
    gconfig = {
        "top_p": 1.0,
        "top_k": int(1e8),
        "max_new_tokens": 8,
        "temperature": 1.0,
        "greedy": False,
        "stop_token_ids": [],
        "ignore_eos": False,
        "skip_special_tokens": True,
        "frequency_penalty": 0.0,
        "stop": ["zz"],
    }
    sample_params = {
        "top_p": gconfig["top_p"],
        "top_k": gconfig["top_k"],
        "max_new_tokens": gconfig["max_new_tokens"],
        "temperature": 0.0 if gconfig["greedy"] else gconfig["temperature"],
        "stop_token_ids": gconfig["stop_token_ids"],
        "ignore_eos": gconfig["ignore_eos"],
        "skip_special_tokens": gconfig["skip_special_tokens"],
        "frequency_penalty": gconfig["frequency_penalty"],
    }
    if gconfig["stop"]:
        sample_params["stop"] = gconfig["stop"]
    payload = {
        "input_ids": [5, 6, 7],
        "image_data": None,
        "sampling_params": sample_params,
        "return_logprob": True,
        "stream": False,
    }
    status, out = http(server.addr, "/generate", payload)
    assert status == 200, out
    meta = out["meta_info"]  # SGLangBackend.parse_generation_response
    assert meta["finish_reason"]["type"] in ("stop", "length")
    tokens = [x[1] for x in meta["output_token_logprobs"]]
    logprobs = [x[0] for x in meta["output_token_logprobs"]]
    assert tokens == out["output_ids"] and 0 < len(tokens) <= 8
    ref = teacher_forced_logprobs(models["ma"], [5, 6, 7] + tokens, 3)
    assert max(abs(a - b) for a, b in zip(ref, logprobs)) <= 1e-4
