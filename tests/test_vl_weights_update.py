"""The distributed weight update of a vision-language model into the CPU rollout server: the
trainer side broadcasts a tiny Qwen2.5-VL's HF tensors (vision tower, projector and language
model, by the names the trainer's export gives them: tests/test_vl_weights.py) in buckets over
gloo to a server serving another checkpoint; the server loads them under its own names and then
scores prompts with images exactly as a fresh server started on that checkpoint."""

import base64
import io

import numpy as np
import pytest
from safetensors.torch import load_file

from areal_mega.inference.process import launch_local_servers
from areal_mega.models.tiny import make_tiny_model
from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
from areal_mega.rollout.client import RolloutClient
from areal_mega.train.weight_sender import DistributedWeightSender, plan_weight_buckets
from tests.helpers.rollout import API_KEY, http

pytestmark = pytest.mark.timeout(300)

TOL = 1e-5
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vl_models(tmp_path_factory):
    """Two tiny Qwen2.5-VL checkpoints with the same shapes and different weights."""
    base = tmp_path_factory.mktemp("vl_update")
    return (
        make_tiny_model(base / "a", arch="qwen2_5_vl", seed=0),
        make_tiny_model(base / "b", arch="qwen2_5_vl", seed=1),
    )


@pytest.fixture(scope="module")
def servers(vl_models):
    """A server on each checkpoint."""
    procs = [launch_local_servers(str(m), 1, api_key=API_KEY)[0] for m in vl_models]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def _picture(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _png_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _score(server, cases) -> list:
    """The input-token logprobs of each ``(ids, image urls)`` prompt (one forward)."""
    status, out = http(
        server,
        "/generate",
        {
            "input_ids": [ids for ids, _ in cases],
            "image_data": [urls for _, urls in cases],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert status == 200, out
    return [[x[0] for x in o["meta_info"]["input_token_logprobs"][1:]] for o in out]


def _worst(a: list, b: list) -> float:
    return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))


def test_vision_and_language_tensors_broadcast_to_the_server(servers, vl_models):
    """Model b's tensors broadcast in several buckets into the server on model a: its
    logprobs on prompts with images then equal those of the server started on b (within
    1e-5; before the update they were clearly a's), at the version sent."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(vl_models[0])
    proc = load_image_processor(vl_models[0])
    images = [[_picture(56, 28, 1), _picture(28, 56, 2)], [_picture(56, 56, 3)]]
    texts = [f"ab{VISION}cd{VISION}", f"count {VISION} here"]
    cases = [
        (encode_sample(t, ims, tok, proc).input_ids.tolist(), [_png_url(im) for im in ims])
        for t, ims in zip(texts, images)
    ]
    served_a, fresh_b = servers
    want = _score(fresh_b, cases)
    assert _worst(_score(served_a, cases), want) > 1e-3  # other weights: other logprobs

    named = sorted(load_file(vl_models[1] / "model.safetensors").items())
    assert any(n.startswith("visual.") for n, _ in named)
    assert any(n.startswith("model.layers.") for n, _ in named)
    bucket_bytes = 200_000
    plan = plan_weight_buckets([(n, t.shape, t.dtype) for n, t in named], bucket_bytes)
    assert len(plan) >= 3
    client = RolloutClient([served_a.addr], api_key=API_KEY, timeout_s=60, retries=1)
    sender = DistributedWeightSender(
        client, backend="gloo", group_name="vl_update", bucket_bytes=bucket_bytes, timeout_s=60
    )
    sender.connect()
    try:
        assert sender.send(iter(named), weight_version=4) == len(plan)
    finally:
        sender.close()
    status, info = http(served_a, "/get_server_info")
    assert status == 200 and info["weight_version"] == "4"
    assert _worst(_score(served_a, cases), want) <= TOL
