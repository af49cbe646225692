"""Checks shared by the elastic server-pool tests: the tokens a server generated, waiting for a
condition, and that every token of an answer came from a given model at a given version."""

import json
import time
import urllib.request

import numpy as np

from tests.helpers.rollout import API_KEY, teacher_forced_logprobs

N_NEW = 96


def tokens_generated(addr) -> int:
    req = urllib.request.Request(
        f"http://{addr}/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)["tokens_generated"]


def wait_for(cond, timeout=120):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def check_tokens(out, prompt, model, version):
    """Every token of ``out`` was made by ``model`` at ``version``: its logprob is the
    teacher-forced one."""
    assert len(out.output_ids) == N_NEW and out.versions == [version] * N_NEW
    ids = list(prompt) + out.output_ids
    ref = teacher_forced_logprobs(model, ids, len(prompt))
    assert np.abs(np.array(ref) - np.array(out.logprobs)).max() <= 1e-4
