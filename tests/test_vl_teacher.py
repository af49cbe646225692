"""On-policy distillation with a served vision-language teacher: the worker keeps each prompt's
images as it sent them (``Trajectory.meta["image_data"]``), the trainer's receiver checks them,
the packed micro-batches carry them and the teacher scorer sends them with the expanded ids.

The end-to-end test (tests/helpers/vl_teacher_worker.py) runs the rollout against a CPU
server serving the tiny Qwen2.5-VL, the trainer intake, the step's planning and ``opd_step``
with the served teacher (the same server) and with the in-trainer teacher (the same
checkpoint): the teacher logprobs agree within 1e-5 on the image samples and the text ones,
and other pictures of the same sizes change an image sample's (the images are scored).
A text teacher server and one of another image processor are refused by name; malformed
``image_data`` is refused by the receiver naming the sample while the rest goes on."""

import json
import logging
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from areal_mega.config import ConfigError, load_config
from areal_mega.dataplane.multimodal import image_data_problem, vision_problem
from areal_mega.inference.process import launch_local_servers
from areal_mega.models.tiny import make_tiny_model
from areal_mega.rollout.scoring import ScoringError, scoring_body, values_of
from areal_mega.train.teacher import build_teacher_scorer, check_served_vision
from tests.helpers.conversions import ROOT
from tests.helpers.rollout import API_KEY, http
from tests.helpers.vl_trajectories import SPEC, make_vl_traj

TOL = 1e-5
PNG = "data:image/png;base64,iVBORw0KGgo="
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("vl_teacher") / "hf", arch="qwen2_5_vl")


@pytest.fixture(scope="module")
def vl_server(hf_dir):
    (proc,) = launch_local_servers(str(hf_dir), 1, api_key=API_KEY)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def mcore_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vl_teacher_mcore") / "mcore"
    p = subprocess.run(
        [sys.executable, "tools/convert_hf_to_mcore.py", "--hf-dir", hf_dir, "--out", out],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return out


def _served_cfg(hf_dir, addr):
    return load_config(
        None,
        [
            f"model.path={hf_dir}",
            "algorithm.opd=pure",
            f"teacher.server_addrs=[{addr}]",
            f"teacher.api_key={API_KEY}",
        ],
    )


@pytest.mark.timeout(900)
def test_served_vl_teacher_equals_the_in_trainer_teacher(hf_dir, mcore_dir, vl_server, tmp_path):
    from tests.helpers.workers import worker_cmd, worker_env

    p = subprocess.run(
        worker_cmd("vl_teacher_worker", hf_dir, mcore_dir, vl_server.addr, tmp_path),
        cwd=ROOT,
        env=worker_env(dict(os.environ, OMP_NUM_THREADS="1")),
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert p.returncode == 0, p.stderr[-6000:]
    res = json.loads((tmp_path / "result.json").read_text())
    images = res["images"]
    assert sorted(images.values()) == [0, 0, 1, 1, 2, 2]  # 3 prompts x 2 samples
    assert res["accepted"] == 6
    # SampleContext kept each prompt's images as sent: one data URL per image, none for text
    for sid, n in images.items():
        data = res["image_data"][sid]
        if n:
            assert len(data) == n and all(u.startswith("data:image/png;base64,") for u in data)
        else:
            assert data is None
    # the micro-batches carried them to the scorer, per sequence
    carried = [n for mb in res["mb_image_data"] if mb is not None for n in mb]
    assert sorted(n for n in carried if n) == [1, 1, 2, 2]
    served, engine = res["served"], res["engine"]
    assert sorted(served) == sorted(engine) == sorted(images)
    for sid in images:
        a, b = np.asarray(served[sid]), np.asarray(engine[sid])
        assert len(a) == len(b) == 4 and (a < 0).all()
        assert np.abs(a - b).max() <= TOL, (sid, images[sid], np.abs(a - b).max())
        # control: other pictures of the same sizes change an image sample's logprobs only
        c = np.asarray(res["other_images"][sid])
        assert (np.abs(c - b).max() > 1e-3) == bool(images[sid]), (sid, np.abs(c - b).max())
    # an image sample whose image_data is missing is dropped from the loss, the rest scored
    stripped = res["stripped"]
    assert stripped["refused"] == 1.0
    for sid, lp in stripped["teacher"].items():
        if sid == stripped["victim"]:
            assert lp == []  # its loss tokens masked out
        else:
            assert np.abs(np.asarray(lp) - np.asarray(served[sid])).max() <= TOL
    # teacher = student (one checkpoint): no reverse KL either way
    assert res["served_abs_log_ratio"] < TOL and res["engine_abs_log_ratio"] < TOL


def test_text_teacher_server_is_refused_for_a_vl_student(hf_dir, server):
    from areal_mega.models.builder import load_hf_config
    from areal_mega.models.vlm.config import vision_spec

    cfg = _served_cfg(hf_dir, server.addr)
    with pytest.raises(ConfigError, match=r"'llama'\), which does not understand images"):
        build_teacher_scorer(cfg, vision_spec(load_hf_config(hf_dir)))


def test_vl_server_reports_image_understanding(vl_server, hf_dir, tmp_path):
    status, info = http(vl_server, "/get_model_info")
    assert status == 200
    assert info["has_image_understanding"] is True
    assert info["model_type"] == "qwen2_5_vl"
    check_served_vision(vl_server.addr, info, str(hf_dir))  # the student's own processor
    # a teacher whose image processor resizes differently: named with both values
    other = tmp_path / "other"
    shutil.copytree(hf_dir, other)
    pre = json.loads((other / "preprocessor_config.json").read_text())
    pre["max_pixels"] = int(pre.get("max_pixels") or 1 << 20) // 2
    (other / "preprocessor_config.json").write_text(json.dumps(pre))
    with pytest.raises(ConfigError, match=r"another image processor.*max_pixels"):
        check_served_vision(vl_server.addr, {**info, "model_path": str(other)}, str(hf_dir))


def test_scoring_body_sends_sglang_batched_image_data():
    body = scoring_body([[1, 2, 3], [4, 5]], [1, 1], [[PNG, PNG], None])
    assert body["image_data"] == [[PNG, PNG], None]
    assert "image_data" not in scoring_body([[1, 2]], [1], [None])
    assert "image_data" not in scoring_body([[1, 2]], [1])
    # the server counted other prompt ids than were sent: named
    answer = {"meta_info": {"prompt_tokens": 5, "input_token_logprobs": [[None, 1], [-1.0, 2]]}}
    with pytest.raises(ScoringError, match="counts 5 prompt tokens, 2 ids were sent"):
        values_of(answer, [1, 2], 1, "x:1", 0)
    answer["meta_info"]["prompt_tokens"] = 2
    assert values_of(answer, [1, 2], 1, "x:1", 0) == [-1.0]


@pytest.mark.parametrize(
    "image_data, problem",
    [
        ("x", "must be a list"),
        ([PNG, PNG], "2 entries for the 1 image"),
        ([7], "not a non-empty string"),
        (["data:text/plain;base64,aGk="], "not data:image/<type>;base64"),
        (["not base64 at all!"], "neither a data URL nor base64"),
    ],
)
def test_bad_image_data_is_a_named_problem(image_data, problem):
    t = make_vl_traj(1)
    assert vision_problem(t, SPEC) is None
    t.meta["image_data"] = image_data
    field, what = vision_problem(t, SPEC)
    assert field == "meta.image_data" and problem in what


def test_receiver_refuses_bad_image_data_naming_the_sample_and_goes_on(tmp_path, caplog):
    from areal_mega.dataplane import TrajectorySender
    from areal_mega.train.intake import TrajectoryIntake

    good = make_vl_traj(2, sample_id="good", group_id="g")
    good.meta["image_data"] = [PNG]
    text = make_vl_traj(3, (), sample_id="text", group_id="g")
    bad = make_vl_traj(4, sample_id="bad", group_id="g")
    bad.meta["image_data"] = [PNG, PNG]  # two strings for one image
    assert image_data_problem(text.meta, 0) is None
    intake = TrajectoryIntake(
        f"ipc://{tmp_path}/a.sock", tmp_path / "run", group_size=2, vision=SPEC
    ).start()
    try:
        with caplog.at_level(logging.WARNING), TrajectorySender(intake.receiver.endpoint) as tx:
            for t in (bad, good, text):
                tx.send(t)
            got = intake.next_groups(1, timeout=60)
        assert sorted(t.sample_id for t in got) == ["good", "text"]
        assert next(t for t in got if t.sample_id == "good").meta["image_data"] == [PNG]
        assert intake.receiver.rejected == {"invalid_field": 1}
        logged = [r.getMessage() for r in caplog.records]
        assert any("meta.image_data" in m and "sample_id='bad'" in m for m in logged)
    finally:
        intake.close()


def test_openai_client_samples_carry_their_images_and_image_data(hf_dir, vl_server):
    """An episode through the in-process OpenAI client with image_url parts: its exported
    trajectory carries the prompt's processed images (encode_sample's) and, in
    ``meta["image_data"]``, the data URLs as sent, and passes the receiver's checks."""
    from transformers import AutoTokenizer

    from areal_mega.models.builder import load_hf_config
    from areal_mega.models.vlm.config import vision_spec
    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
    from areal_mega.rollout.client import RolloutClient
    from areal_mega.rollout.controller import RolloutController
    from areal_mega.workflow.api import EpisodeWorkflow
    from tests.helpers.rollout import GroupSink
    from tests.helpers.vl_teacher_worker import png_url

    class ChatWorkflow(EpisodeWorkflow):
        async def episode(self, ctx, item):
            await ctx.client.chat.completions.create(messages=item["messages"], max_tokens=3)
            return 1.0

    from PIL import Image

    rng = np.random.default_rng(5)
    sizes = ((28, 56), (56, 28))
    imgs = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    urls = [png_url(im) for im in imgs]
    parts = [{"type": "text", "text": "look"}]
    parts += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    tok, proc = AutoTokenizer.from_pretrained(hf_dir), load_image_processor(hf_dir)
    sink = GroupSink()
    ctl = RolloutController(
        RolloutClient([vl_server.addr], api_key=API_KEY, timeout_s=120, retries=2),
        ChatWorkflow(),
        [{"messages": [{"role": "user", "content": parts}]}],
        batch_size=1,
        n_samples=2,
        eta=1,
        sink=sink,
        tokenizer=tok,
        image_processor=proc,
        ignore_eos=True,
    ).start()
    try:
        (group,) = sink.take(ctl, 1, timeout=120)
    finally:
        ctl.stop()
    want = encode_sample("x" + VISION * 2, imgs, tok, proc)
    spec = vision_spec(load_hf_config(hf_dir))
    assert len(group) == 2
    for t in group:
        assert t.meta["image_data"] == urls
        assert np.array_equal(t.multimodal["pixel_values"], want.pixel_values.numpy())
        assert t.multimodal["image_grid_thw"].tolist() == want.image_grid_thw.tolist()
        assert vision_problem(t, spec) is None
