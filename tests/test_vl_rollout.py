"""Images through the CPU rollout server (contract C1) on the tiny Qwen2.5-VL, as a real server
process driven by the real client and controller: each sampled token's logprob equals
transformers' own forward over prompt + output with the images (its own multimodal positions),
for prompts with different images, several images and none, prefilled in one batch; the vision
special tokens are never sampled; bad image requests are answered 400 naming the problem; a
pause / weight update / continue cycle resends the images with the partial output."""

import asyncio
import base64
import io
import json
import time
import urllib.request

import numpy as np
import pytest
import torch

from areal_mega.inference.process import launch_local_servers
from areal_mega.models.tiny import make_tiny_model
from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
from areal_mega.rollout.client import RolloutClient, sampling_dict
from areal_mega.rollout.controller import RolloutController
from areal_mega.workflow.api import EpisodeWorkflow
from tests.helpers.rollout import API_KEY, GroupSink, http, run

pytestmark = pytest.mark.timeout(300)

TOL = 1e-5
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vl_models(tmp_path_factory):
    """Two tiny Qwen2.5-VL checkpoints with the same shapes and different weights."""
    base = tmp_path_factory.mktemp("vl_rollout")
    return (
        make_tiny_model(base / "a", arch="qwen2_5_vl", seed=0),
        make_tiny_model(base / "b", arch="qwen2_5_vl", seed=1),
    )


@pytest.fixture(scope="module")
def server(vl_models):
    (proc,) = launch_local_servers(str(vl_models[0]), 1, api_key=API_KEY)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def ref(vl_models):
    """transformers' models a and b, the tokenizer, the image processor and the vision ids."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    torch.set_num_threads(1)
    models = [
        AutoModelForImageTextToText.from_pretrained(p, dtype=torch.float32).eval()
        for p in vl_models
    ]
    cfg = models[0].config
    banned = [
        cfg.image_token_id,
        cfg.video_token_id,
        cfg.vision_start_token_id,
        cfg.vision_end_token_id,
    ]
    return {
        "models": models,
        "tok": AutoTokenizer.from_pretrained(vl_models[0]),
        "proc": load_image_processor(vl_models[0]),
        "banned": banned,
    }


def picture(w: int, h: int, seed: int):
    """A noise RGB image of ``w`` x ``h`` pixels."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def png_url(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def prompt(ref, text: str, images: list):
    """``(expanded ids, VLSample)`` of ``text`` with one placeholder per image."""
    s = encode_sample(text, images, ref["tok"], ref["proc"])
    return s.input_ids.tolist(), s


@torch.no_grad()
def reference_logprobs(model, sample, output_ids: list, banned: list) -> list:
    """transformers' logprob of each output token after ``sample``'s prompt, its own positions
    from ``mm_token_type_ids`` and the images, with the vision tokens at -inf (what the
    server samples from)."""
    full = torch.cat([sample.input_ids, torch.tensor(output_ids, dtype=torch.long)])[None]
    kw = {}
    if sample.pixel_values is not None:
        kw = dict(
            pixel_values=sample.pixel_values,
            image_grid_thw=sample.image_grid_thw,
            mm_token_type_ids=(full == model.config.image_token_id).to(torch.int),
        )
    model.model.rope_deltas = None
    logits = model(input_ids=full, use_cache=False, **kw).logits[0].float()
    logits[:, banned] = float("-inf")
    lp = torch.log_softmax(logits, -1)
    P = sample.input_ids.numel()
    return [float(lp[P + t - 1, tok]) for t, tok in enumerate(output_ids)]


def client_for(server):
    return RolloutClient([server.addr], api_key=API_KEY, timeout_s=120, retries=1)


def test_logprobs_with_images_equal_transformers(server, ref):
    """Six prompts decoded together: one image of 1, 4 and 2 merged patches, two images in
    one prompt, none, and a prompt of the same length as the first with another image (the
    two share a prefill forward). Every logprob equals transformers' within 1e-5, no vision
    token is sampled, and the images matter (the other image's reference is far off)."""
    imgs = [
        picture(28, 28, 1),
        picture(56, 56, 2),
        picture(40, 56, 3),
        picture(30, 30, 4),
        picture(56, 28, 5),
        picture(28, 28, 6),
    ]
    cases = [
        prompt(ref, f"12{VISION}34", [imgs[0]]),
        prompt(ref, f"what is {VISION} here?", [imgs[1]]),
        prompt(ref, f"{VISION}count", [imgs[2]]),
        prompt(ref, f"a{VISION}b{VISION}c", [imgs[3], imgs[4]]),
        prompt(ref, "no image at all", []),
        prompt(ref, f"12{VISION}34", [imgs[5]]),
    ]
    images = [[imgs[0]], [imgs[1]], [imgs[2]], [imgs[3], imgs[4]], [], [imgs[5]]]
    assert len(cases[0][0]) == len(cases[5][0])

    async def go():
        c = client_for(server)
        try:
            return await asyncio.gather(
                *[
                    c.generate(
                        ids,
                        sampling_dict(24, 1.0, ignore_eos=True),
                        image_data=[png_url(im) for im in ims] or None,
                    )
                    for (ids, _), ims in zip(cases, images)
                ]
            )
        finally:
            await c.close()

    results = run(go())
    model = ref["models"][0]
    for (ids, sample), res in zip(cases, results):
        assert res.finish_type == "length" and len(res.output_ids) == 24
        assert not set(res.output_ids) & set(ref["banned"])
        want = reference_logprobs(model, sample, res.output_ids, ref["banned"])
        assert max(abs(a - b) for a, b in zip(want, res.logprobs)) <= TOL
    # the same tokens under the other image of the same length: clearly other logprobs
    other = reference_logprobs(model, cases[5][1], results[0].output_ids, ref["banned"])
    assert max(abs(a - b) for a, b in zip(other, results[0].logprobs)) > 1e-3


def test_vision_tokens_are_never_sampled(server, ref):
    """Even a logit_bias of +50 on every vision token never makes one sampled: they are -inf
    before the bias; the reported logprobs stay finite."""
    ids, _ = prompt(ref, f"x{VISION}y", [picture(56, 56, 7)])
    bias = {str(t): 50.0 for t in ref["banned"]}
    status, out = http(
        server,
        "/generate",
        {
            "input_ids": ids,
            "image_data": [png_url(picture(56, 56, 7))],
            "sampling_params": {
                "max_new_tokens": 40,
                "temperature": 1.0,
                "ignore_eos": True,
                "logit_bias": bias,
                "n": 3,
            },
            "return_logprob": True,
        },
    )
    assert status == 200, out
    for o in out:
        assert len(o["output_ids"]) == 40
        assert not set(o["output_ids"]) & set(ref["banned"])
        assert all(np.isfinite(x[0]) for x in o["meta_info"]["output_token_logprobs"])


def big_png_url(w: int, h: int) -> str:
    """A one-bit black PNG of ``w`` x ``h`` pixels (small on the wire)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (w, h)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_bad_image_requests_are_400_naming_the_problem(server, ref):
    """Placeholder count vs the images' token count, image count vs placeholder runs, an
    undecodable image, too many pixels, a remote URL, placeholders without images, videos:
    each a 400 naming it; the server keeps serving."""
    four = picture(56, 56, 8)  # 4 merged patches
    ids4, _ = prompt(ref, f"a{VISION}b", [four])
    pad = ref["tok"].convert_tokens_to_ids("<|image_pad|>")
    video = ref["tok"].convert_tokens_to_ids("<|video_pad|>")
    short = [t for i, t in enumerate(ids4) if not (t == pad and i == ids4.index(pad))]
    two_in_one_run = ids4[: ids4.index(pad)] + [pad] * 8 + ids4[ids4.index(pad) + 4 :]
    cases = [
        (short, [png_url(four)], "3 <|image_pad|> tokens in input_ids, but the images need"),
        (two_in_one_run, [png_url(four)] * 2, "2 image(s) in image_data but 1 runs"),
        (ids4, ["data:image/png;base64," + base64.b64encode(b"no png").decode()], "decodable"),
        (ids4, [big_png_url(8200, 8200)], "more than max_source_pixels"),
        (ids4, ["https://example.com/cat.png"], "remote image URLs are not fetched"),
        (ids4, None, "4 <|image_pad|> tokens but no image_data"),
        (ids4 + [video], [png_url(four)], "videos are not served"),
        (ids4, ["@@not base64@@"], "neither a data URL, a file on this server nor base64"),
    ]
    for ids, data, message in cases:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}
        if data is not None:
            body["image_data"] = data
        status, out = http(server, "/generate", body)
        assert status == 400, (message, out)
        assert message in out["error"]["message"], out
    # raw base64 (no data URL) is an image too, and the server still answers
    raw = png_url(four).split(",", 1)[1]
    status, out = http(
        server,
        "/generate",
        {"input_ids": ids4, "image_data": raw, "sampling_params": {"max_new_tokens": 2}},
    )
    assert status == 200 and len(out["output_ids"]) == 2, out


class ImagePromptWorkflow(EpisodeWorkflow):
    """One completion of a prompt item carrying expanded ``input_ids`` and ``image_data``."""

    def __init__(self, max_new_tokens: int):
        self.max_new_tokens = max_new_tokens

    async def episode(self, ctx, item: dict) -> list:
        ids = list(item["input_ids"])
        gen = await ctx.generate(ids, self.max_new_tokens, image_data=item["image_data"])
        seq = ctx.new_sequence(ids)
        seq.add_generated(gen.output_ids, gen.logprobs, gen.versions, gen.routed_experts)
        meta = {"n_interruptions": gen.n_interruptions, "item": item["k"]}
        return [ctx.trajectory(seq, 0.0, len(ids), gen.finish_reason, server_id=gen.server, meta=meta)]


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


def restore_model_a(server, path):
    async def go():
        c = client_for(server)
        try:
            await c.update_weights_from_disk(str(path), weight_version=0)
        finally:
            await c.close()

    run(go())


N_NEW = 160


def test_interrupted_image_generation_resumes_with_its_images(server, ref, vl_models):
    """Pause mid-generation, load model b, continue: each interrupted request is resent with
    its images and its partial output; its tokens switch from version 0 to 1 where it was
    interrupted, and each logprob is transformers' of the model version that produced it,
    with the images."""
    addr = server.addr
    items, samples = [], []
    for k in range(4):
        ims = [picture(28 + 14 * (k % 3), 56, 20 + k)]
        ids, s = prompt(ref, f"{k}{VISION}?", ims)
        items.append({"k": k, "input_ids": ids, "image_data": [png_url(im) for im in ims]})
        samples.append(s)
    sink = GroupSink()
    client = RolloutClient([addr], api_key=API_KEY, timeout_s=120, retries=4, backoff_s=0.05)
    ctl = RolloutController(
        client,
        ImagePromptWorkflow(N_NEW),
        items,
        batch_size=4,
        n_samples=2,
        eta=1,
        sink=sink,
        tokenizer=ref["tok"],
        ignore_eos=True,
    ).start()
    base = tokens_generated(addr)
    try:
        wait_for(lambda: ctl.n_inflight_requests >= 8)
        wait_for(lambda: tokens_generated(addr) - base >= 40)
        ctl.update_weights(1, path=str(vl_models[1]))
        groups = sink.take(ctl, 4, timeout=240)
    finally:
        ctl.stop()
        restore_model_a(server, vl_models[0])
    trajs = [t for g in groups for t in g]
    assert len(trajs) == 8
    n_interrupted = 0
    for t in trajs:
        P = t.prompt_len
        sample = samples[t.meta["item"]]
        assert t.input_ids[:P].tolist() == sample.input_ids.tolist()
        out = t.input_ids[P:].tolist()
        assert len(out) == N_NEW and not set(out) & set(ref["banned"])
        gen_v = t.versions[P:]
        assert set(gen_v.tolist()) <= {0, 1} and (np.diff(gen_v) >= 0).all()
        k = int((gen_v == 0).sum())
        if 0 < k < N_NEW:
            n_interrupted += 1
            assert t.meta["n_interruptions"] == 1
        lp_a = reference_logprobs(ref["models"][0], sample, out, ref["banned"])[:k]
        lp_b = reference_logprobs(ref["models"][1], sample, out, ref["banned"])[k:]
        assert np.abs(np.array(lp_a + lp_b) - t.logprobs[P:]).max() <= TOL
    assert n_interrupted >= 4
