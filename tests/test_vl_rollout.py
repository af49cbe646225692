"""Images through the CPU rollout server (contract C1) on the tiny Qwen2.5-VL, as a real server
process driven by the real client and controller: each sampled token's logprob equals
transformers' own forward over prompt + output with the images (its own multimodal positions),
for prompts with different images, several images and none, prefilled in one batch; the vision
special tokens are never sampled; bad image requests are answered 400 naming the problem; a
pause / weight update / continue cycle resends the images with the partial output. The checks of
the logprobs, the vision tokens and the running batch's prefill run on the tiny Qwen3-VL too
(16-pixel patches, deepstack features, its own multimodal positions): the same images are one to
four merged patches for either processor."""

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


def reference(paths) -> dict:
    """transformers' models of ``paths``, the tokenizer, the image processor and the vision
    ids."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    torch.set_num_threads(1)
    models = [
        AutoModelForImageTextToText.from_pretrained(p, dtype=torch.float32).eval() for p in paths
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
        "tok": AutoTokenizer.from_pretrained(paths[0]),
        "proc": load_image_processor(paths[0]),
        "banned": banned,
    }


@pytest.fixture(scope="module")
def ref(vl_models):
    """transformers' models a and b, the tokenizer, the image processor and the vision ids."""
    return reference(vl_models)


@pytest.fixture(scope="module")
def qwen3_vl_model(tmp_path_factory):
    """A tiny Qwen3-VL checkpoint."""
    return make_tiny_model(tmp_path_factory.mktemp("vl_rollout_q3") / "a", arch="qwen3_vl", seed=0)


@pytest.fixture(scope="module")
def qwen3_vl_server(qwen3_vl_model):
    (proc,) = launch_local_servers(str(qwen3_vl_model), 1, api_key=API_KEY)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def qwen3_vl_ref(qwen3_vl_model):
    """:func:`reference` of the tiny Qwen3-VL."""
    return reference([qwen3_vl_model])


#: the families whose serving checks run here (each its own server and reference)
FAMILIES = ("qwen2_5_vl", "qwen3_vl")


@pytest.fixture(params=FAMILIES)
def family_ref(request):
    """The reference of each family."""
    return request.getfixturevalue("ref" if request.param == "qwen2_5_vl" else "qwen3_vl_ref")


@pytest.fixture(params=FAMILIES)
def served(request):
    """(server, reference) of each family."""
    if request.param == "qwen2_5_vl":
        return request.getfixturevalue("server"), request.getfixturevalue("ref")
    return request.getfixturevalue("qwen3_vl_server"), request.getfixturevalue("qwen3_vl_ref")


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


def test_logprobs_with_images_equal_transformers(served):
    """Seven prompts decoded together: one image of 1, 4 and 2 merged patches, two images in
    one prompt, none, and two prompts of the same length as the first, one with another image
    and one without (the three may share a prefill forward). Every logprob equals
    transformers' within 1e-5, no vision token is sampled, and the images matter (the other
    image's reference is far off)."""
    server, ref = served
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
        prompt(ref, "12xyz34", []),
    ]
    images = [[imgs[0]], [imgs[1]], [imgs[2]], [imgs[3], imgs[4]], [], [imgs[5]], []]
    assert len(cases[0][0]) == len(cases[5][0]) == len(cases[6][0])

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
    for (_, sample), res in zip(cases, results):
        assert res.finish_type == "length" and len(res.output_ids) == 24
        assert not set(res.output_ids) & set(ref["banned"])
        want = reference_logprobs(model, sample, res.output_ids, ref["banned"])
        assert max(abs(a - b) for a, b in zip(want, res.logprobs)) <= TOL
    # the same tokens under the other image of the same length: clearly other logprobs
    other = reference_logprobs(model, cases[5][1], results[0].output_ids, ref["banned"])
    assert max(abs(a - b) for a, b in zip(other, results[0].logprobs)) > 1e-3
    # no prefix cache for a VL model (the server's default budget is not 0): keys/values
    # computed with one prompt's images never serve another
    status, info = http(server, "/get_server_info")
    assert status == 200 and info["prefix_cache"] is None and info["cached_tokens"] == 0


def test_vision_tokens_are_never_sampled(served):
    """Even a logit_bias of +50 on every vision token never makes one sampled: they are -inf
    before the bias; the reported logprobs stay finite."""
    server, ref = served
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


def test_input_token_logprobs_with_images_equal_transformers(served):
    """``max_new_tokens: 0`` with ``logprob_start_len: 0`` scores a prompt with images (two
    prompts of one length in one forward): SGLang's input logprobs (raw, temperature 1, no
    vision mask) equal transformers' forward with the images."""
    server, ref = served
    images = [
        [picture(56, 28, 11), picture(28, 56, 12)],
        [picture(28, 56, 13), picture(56, 28, 14)],
    ]
    cases = [prompt(ref, f"ab{VISION}cd{VISION}", ims) for ims in images]
    status, out = http(
        server,
        "/generate",
        {
            "input_ids": [ids for ids, _ in cases],
            "image_data": [[png_url(im) for im in ims] for ims in images],
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert status == 200, out
    model = ref["models"][0]
    for (ids, s), o in zip(cases, out):
        got = o["meta_info"]["input_token_logprobs"]
        assert got[0][0] is None and [x[1] for x in got] == ids
        with torch.no_grad():
            model.model.rope_deltas = None
            logits = (
                model(
                    input_ids=s.input_ids[None],
                    pixel_values=s.pixel_values,
                    image_grid_thw=s.image_grid_thw,
                    mm_token_type_ids=s.mm_token_type_ids[None],
                )
                .logits[0]
                .float()
            )
        lp = torch.log_softmax(logits, -1)
        want = [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))]
        assert max(abs(a - b[0]) for a, b in zip(want, got[1:])) <= TOL


def big_png_url(w: int, h: int) -> str:
    """A one-bit black PNG of ``w`` x ``h`` pixels (small on the wire)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("1", (w, h)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_bad_image_requests_are_400_naming_the_problem(server, ref):
    """Placeholder count vs the images' token count, image count vs placeholder runs, an
    undecodable image, too many pixels, a remote URL, placeholders without images, videos,
    more images than the server's limit: each a 400 naming it; the server keeps serving."""
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
        (ids4, [png_url(four)] * 17, "17 images, more than 16 (the server's --max-images"),
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
        return [
            ctx.trajectory(seq, 0.0, len(ids), gen.finish_reason, server_id=gen.server, meta=meta)
        ]


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


N_NEW = 400  # a prompt (< 20 tokens) + 400 fits the tiny model's 512 positions


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


def test_forbidden_tokens_and_prompt_length_check(vl_models, ref, tmp_path):
    """The vision tokens the worker forbids are the checkpoint's (none for a text model); they
    join a request's own logit_bias at FORBIDDEN_BIAS; an answer whose prompt length differs
    from the expanded ids sent is refused; the vllm backend refuses images naming why."""
    from areal_mega.backends.vllm.client import vllm_generate_body
    from areal_mega.inference.vl_model import checkpoint_vision_token_ids
    from areal_mega.rollout.generate_result import (
        FORBIDDEN_BIAS,
        GenerateResult,
        RolloutRequestError,
        check_prompt_tokens,
        forbid_tokens,
        generate_body,
    )

    ids = checkpoint_vision_token_ids(vl_models[0], ref["tok"])
    assert ids == sorted(ref["banned"])
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_vision_token_ids(tmp_path) == []
    sp = forbid_tokens({"temperature": 1.0, "logit_bias": {"3": 2.0}}, ids)
    assert sp["logit_bias"] == {"3": 2.0, **{str(t): FORBIDDEN_BIAS for t in ids}}
    assert forbid_tokens({"temperature": 1.0}, ()) == {"temperature": 1.0}

    def answer(n):
        meta = {"meta_info": {"prompt_tokens": n}}
        return GenerateResult([1], [0.0], {"type": "length"}, "0", "s", meta)

    check_prompt_tokens(answer(12), 12)
    with pytest.raises(RolloutRequestError, match="expanded the prompt with its images to 13"):
        check_prompt_tokens(answer(13), 12)
    body = generate_body([1, 2], {"max_new_tokens": 2}, image_data=["data:image/png;base64,AA=="])
    assert body["image_data"] == ["data:image/png;base64,AA=="]
    with pytest.raises(RolloutRequestError, match="images are not sent to the vllm backend"):
        vllm_generate_body(body)


class ChatImageWorkflow(EpisodeWorkflow):
    """The item's chat once through the in-process OpenAI client and once through the HTTP
    endpoint; keeps the records."""

    def __init__(self):
        self.records = []

    async def episode(self, ctx, item: dict):
        import aiohttp

        out = await ctx.client.chat.completions.create(
            messages=item["messages"], max_tokens=12, temperature=1.0
        )
        assert out.choices[0].finish_reason == "length"
        url, key = await ctx.openai_endpoint()
        body = {"messages": item["messages"], "max_tokens": 12, "temperature": 1.0}
        async with aiohttp.ClientSession() as s:
            async with s.post(
                url + "/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as r:
                assert r.status == 200, await r.text()
        ctx.close_endpoint(key)
        self.records.extend(ctx.client.records)
        return 0.0


def test_openai_chat_with_image_url_parts(server, ref):
    """Chat messages with data-URL image_url parts (in process and over HTTP) render through
    the chat template, expand through the image processor and generate with the images: the
    recorded prompt is encode_sample's, the decoded images stay on the record, each logprob is
    transformers'. A remote URL, or images for a text policy, are refused with a clear
    message."""
    from areal_mega.workflow.openai_client import OpenAIRequestError, chat_request

    ims = [[picture(56, 56, 30)], [picture(28, 56, 31), picture(56, 28, 32)]]
    items = []
    for k, group in enumerate(ims):
        parts = [{"type": "text", "text": f"{k} look"}]
        parts += [{"type": "image_url", "image_url": {"url": png_url(im)}} for im in group]
        parts.append({"type": "text", "text": "?"})
        items.append({"k": k, "messages": [{"role": "user", "content": parts}]})
    wf = ChatImageWorkflow()
    sink = GroupSink()
    client = RolloutClient([server.addr], api_key=API_KEY, timeout_s=120, retries=2)
    ctl = RolloutController(
        client,
        wf,
        items,
        batch_size=2,
        n_samples=1,
        eta=1,
        sink=sink,
        tokenizer=ref["tok"],
        image_processor=ref["proc"],
        ignore_eos=True,
    ).start()
    try:
        sink.take(ctl, 2, timeout=120)
    finally:
        ctl.stop()
    assert len(wf.records) == 4
    for rec in wf.records:
        k = int(ref["tok"].decode(rec.prompt_ids[:1]))
        text = f"{k} look" + VISION * len(ims[k]) + "?"
        ids, sample = prompt(ref, text, ims[k])
        assert rec.prompt_ids == ids and len(rec.images) == len(ims[k])
        assert [np.asarray(a).tolist() for a in rec.images] == [
            np.asarray(b).tolist() for b in ims[k]
        ]
        want = reference_logprobs(ref["models"][0], sample, rec.output_ids, ref["banned"])
        assert max(abs(a - b) for a, b in zip(want, rec.logprobs)) <= TOL

    async def never(*a, **kw):
        raise AssertionError("nothing is generated for a refused request")

    def image_message(url):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]

    remote = image_message("https://example.com/a.png")
    local = image_message(png_url(ims[0][0]))
    for msgs, proc, message in [
        (remote, ref["proc"], "remote images are not fetched"),
        (local, None, "need a vision-language policy"),
    ]:
        with pytest.raises(OpenAIRequestError, match=message):
            run(chat_request({"messages": msgs}, never, ref["tok"], [], 8, image_processor=proc))


def test_one_prefill_of_rows_with_other_images_or_none_equals_each_alone(family_ref):
    """The running batch's prefill of equal-length rows with different images and a row
    without, then two decode steps, gives each row what it gets alone (positions per row) and
    what transformers' forward over the whole sequence with the images gives."""
    ref = family_ref
    from areal_mega.inference.kv_cache import HFCacheBatch
    from areal_mega.inference.vl_model import PromptImages

    model = ref["models"][0]
    # 4 image tokens on a 2x2 grid of merged patches: 2 positions, a rope delta of -2
    first = prompt(ref, f"1{VISION}4", [picture(56, 56, 40)])
    rows = [
        first,
        prompt(ref, "x" * len(first[0]), []),
        prompt(ref, f"1{VISION}4", [picture(56, 56, 41)]),
    ]
    assert len({len(ids) for ids, _ in rows}) == 1

    def images_of(s):
        if s.pixel_values is None:
            return None
        return PromptImages(s.pixel_values, s.image_grid_thw, [])

    def run_rows(chosen):
        batch = HFCacheBatch(model)
        ids = torch.tensor([rows[i][0] for i in chosen])
        with torch.no_grad():
            logits, kv = batch.prefill(ids, images=[images_of(rows[i][1]) for i in chosen])
            batch.append(kv, list(range(len(chosen))))
            out = [logits]
            for tok in (3, 5):
                out.append(batch.decode([tok] * len(chosen)))
        return torch.stack(out, 1)  # [rows, steps, vocab]

    together = run_rows([0, 1, 2])
    for i, (ids, s) in enumerate(rows):
        assert (together[i] - run_rows([i])[0]).abs().max() <= TOL
        full = torch.tensor([ids + [3, 5]])
        kw = {}
        if s.pixel_values is not None:
            kw = dict(
                pixel_values=s.pixel_values,
                image_grid_thw=s.image_grid_thw,
                mm_token_type_ids=(full == model.config.image_token_id).to(torch.int),
            )
        with torch.no_grad():
            model.model.rope_deltas = None
            want = model(input_ids=full, use_cache=False, **kw).logits[0, len(ids) - 1 :].float()
        assert (together[i] - want).abs().max() <= TOL


def test_teacher_scoring_with_images_equals_transformers(server, ref):
    """On-policy distillation's teacher scoring sends each sequence's images: the scores of
    two sequences with other images (and one without) equal transformers' raw logprobs."""
    from areal_mega.rollout.scoring import TeacherServerScorer

    ims = [[picture(56, 56, 50)], None, [picture(28, 56, 51), picture(56, 28, 52)]]
    texts = [f"a{VISION}bcd", "abcdefg", f"{VISION}x{VISION}yz"]
    cases = [prompt(ref, t, im or []) for t, im in zip(texts, ims)]
    seqs = [ids for ids, _ in cases]
    starts = [2, 3, 1]
    data = [[png_url(i) for i in im] if im else None for im in ims]
    with TeacherServerScorer([server.addr], api_key=API_KEY, timeout_s=120) as scorer:
        got = scorer.score(seqs, starts, image_data=data)
    model = ref["models"][0]
    for (ids, s), k, values in zip(cases, starts, got):
        kw = {}
        if s.pixel_values is not None:
            kw = dict(
                pixel_values=s.pixel_values,
                image_grid_thw=s.image_grid_thw,
                mm_token_type_ids=s.mm_token_type_ids[None],
            )
        with torch.no_grad():
            model.model.rope_deltas = None
            logits = model(input_ids=s.input_ids[None], **kw).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        want = [float(lp[t - 1, ids[t]]) for t in range(k, len(ids))]
        assert len(values) == len(want) and np.abs(np.asarray(want) - values).max() <= TOL


def test_qwen3_vl_prompt_records_fit_its_vision_spec(qwen3_vl_model, qwen3_vl_ref, tmp_path):
    """The data path of a Qwen3-VL policy: a dataset record's image is encoded by its own
    processor (16-pixel patches: ``3·2·16² = 1536`` values each, merged 2x2), its placeholder
    expanded to the image's merged patches, and the trainer's receiver takes the sample under the
    model's :class:`VisionSpec` (read from the Qwen3-VL config), which refuses Qwen2.5-VL's
    14-pixel patches."""
    from areal_mega.data.dataset import PromptDataset, load_tokenizer
    from areal_mega.data.synthetic_vision import write_task
    from areal_mega.data.vision_prompts import VisionPrompts
    from areal_mega.dataplane.multimodal import vision_problem
    from areal_mega.dataplane.trajectory import Trajectory
    from areal_mega.models.builder import load_hf_config
    from areal_mega.models.vlm.config import vision_spec

    hf = load_hf_config(qwen3_vl_model)
    spec = vision_spec(hf)
    tok = load_tokenizer(str(qwen3_vl_model))
    proc = qwen3_vl_ref["proc"]
    assert spec.image_token_id == hf["image_token_id"] == tok.convert_tokens_to_ids("<|image_pad|>")
    assert spec.merge_size == proc.merge_size == 2 and proc.patch_size == 16
    assert spec.patch_dim == 3 * 2 * 16 * 16
    data = write_task(tmp_path, "count", n_train=3, n_test=1, seed=1, question="=")
    ds = PromptDataset(data / "train.jsonl", tok, vision=VisionPrompts(str(qwen3_vl_model)))
    for i in range(len(ds)):
        f = ds.prompt_fields(i)
        mm = f["multimodal"]
        (grid,) = mm["image_grid_thw"]
        assert mm["pixel_values"].shape == (int(np.prod(grid)), spec.patch_dim)
        ids = np.asarray(f["input_ids"] + [3, 4])
        assert int((ids == spec.image_token_id).sum()) == int(np.prod(grid)) // 4
        n = len(ids)
        traj = Trajectory(
            input_ids=ids,
            loss_mask=np.r_[np.zeros(n - 2), np.ones(2)].astype(np.int32),
            logprobs=np.zeros(n, np.float32),
            versions=np.r_[-np.ones(n - 2), np.zeros(2)].astype(np.int32),
            sample_id=f"s{i}",
            group_id=f"g{i}",
            prompt_len=n - 2,
            meta={"image_data": f["image_data"]},
            multimodal=mm,
        )
        assert traj.validate() is traj and vision_problem(traj, spec) is None
        narrow = np.zeros((len(mm["pixel_values"]), 3 * 2 * 14 * 14), np.float32)
        traj.multimodal = dict(mm, pixel_values=narrow)
        field, problem = vision_problem(traj, spec)
        assert field == "multimodal.pixel_values" and "patch_dim 1176" in problem, problem
