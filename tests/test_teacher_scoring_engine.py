"""A teacher served by our CPU server scores the student's tokens exactly as the same teacher
would inside the trainer: ``TeacherServerScorer`` (SGLang's scoring request over HTTP) against
the trainer's own Megatron forward of the same weights (converted HF -> megatron, the path the
trainer takes), fp32 on CPU, within 1e-5."""

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from areal_mega.rollout.scoring import TeacherServerScorer
from tests.helpers.rollout import API_KEY
from tests.helpers.workers import worker_cmd

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_server_scoring_equals_the_trainers_megatron_forward(server, models, tmp_path):
    rng = np.random.default_rng(3)
    seqs = [rng.integers(3, 100, size=n).tolist() for n in (9, 17, 17, 30)]
    starts = [1, 4, 16, 11]
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"seqs": seqs, "starts": starts}))
    out = tmp_path / "out.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        worker_cmd("teacher_forward_worker", models["a"], tmp_path, job, out),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    engine = json.loads(out.read_text())["logprobs"]
    with TeacherServerScorer([server.addr], api_key=API_KEY) as scorer:
        served = scorer.score(seqs, starts)
    for i, (want, got) in enumerate(zip(engine, served)):
        assert len(got) == len(want) == len(seqs[i]) - starts[i]
        assert np.abs(np.asarray(want) - got).max() <= 1e-5, (
            i,
            np.abs(np.asarray(want) - got).max(),
        )
