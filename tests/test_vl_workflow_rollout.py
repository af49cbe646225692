"""The built-in RLVR workflow on prompts with images, as the rollout worker runs it: the
worker's prompt cursor over a dataset of image records, the controller, a CPU rollout server
(contract C3). Each group's prompt is encoded once: every sample of the group carries the very
same patches (one array, not a copy per sample), equal to the image processor's on the image
file; the prompt tokens are the image-expanded ids; the server was sent the images (the
completions differ with them) and never returns a vision token; every trajectory passes the
trainer's receiver checks against the model's VisionSpec."""

import json

import numpy as np
import pytest
from PIL import Image

from areal_mega.data.dataset import PromptDataset, load_tokenizer
from areal_mega.data.synthetic_vision import write_task
from areal_mega.data.vision_prompts import VisionPrompts
from areal_mega.dataplane.multimodal import vision_problem
from areal_mega.inference.process import launch_local_servers
from areal_mega.models.builder import load_hf_config
from areal_mega.models.tiny import make_tiny_model
from areal_mega.models.vlm.config import vision_spec
from areal_mega.models.vlm.inputs import encode_sample, load_image_processor
from areal_mega.rewards import load_reward_fn
from areal_mega.rollout.client import RolloutClient
from areal_mega.rollout.controller import RolloutController
from areal_mega.rollout.worker import PromptCursor, StampedWorkflow
from areal_mega.workflow.builtin import MultiTurnWorkflow, RetryEnvironment, RLVRWorkflow
from tests.helpers.rollout import API_KEY, GroupSink

pytestmark = pytest.mark.timeout(300)
N_SAMPLES = 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny Qwen2.5-VL, a dataset of three image records with the same text, its tokenizer
    and a CPU rollout server."""
    d = tmp_path_factory.mktemp("vl_workflow")
    # initializer_range 0.2: greedy completions that differ with the image (0.02's do not)
    model = make_tiny_model(
        d / "model", arch="qwen2_5_vl", charset="digits", seed=5, initializer_range=0.2
    )
    data = write_task(d / "data", "count", n_train=3, n_test=1, seed=5, question="=")
    (proc,) = launch_local_servers(str(model), 1, api_key=API_KEY)
    try:
        yield model, data, load_tokenizer(str(model)), proc
    finally:
        proc.stop()


def _groups(setup, workflow, n_groups=3):
    """``n_groups`` groups of the dataset's prompts (in order) run by ``workflow`` as the
    rollout worker runs it: its prompt cursor, the controller, greedy decoding."""
    model, data, tok, proc = setup
    ds = PromptDataset(data / "train.jsonl", tok, vision=VisionPrompts(str(model)))
    sink = GroupSink()
    client = RolloutClient([proc.addr], api_key=API_KEY, timeout_s=120, retries=4)
    ctl = RolloutController(
        client,
        StampedWorkflow(workflow),
        PromptCursor(ds, seed=0, shuffle=False),
        batch_size=n_groups,
        n_samples=N_SAMPLES,
        eta=1,
        sink=sink,
        tokenizer=tok,
        temperature=0.0,
        ignore_eos=True,
    ).start()
    try:
        return ds, sink.take(ctl, n_groups, timeout=240)
    finally:
        ctl.stop()


def test_rlvr_groups_share_one_encoding_of_their_images(setup):
    model, data, tok, _ = setup
    reward = load_reward_fn("areal_mega.rewards:char_match_reward")
    ds, groups = _groups(setup, RLVRWorkflow(reward, 5))
    records = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()]
    proc_ = load_image_processor(model)
    spec = vision_spec(load_hf_config(model))
    banned = {spec.image_token_id, tok.convert_tokens_to_ids("<|vision_start|>")}
    outputs = []
    for group in groups:
        assert len(group) == N_SAMPLES
        k = int(group[0].meta["prompt_index"])  # not shuffled: prompt k is record k
        rec = records[k]
        img = Image.open(data / rec["prompt"][0]["content"][0]["image"]).convert("RGB")
        want = encode_sample(ds[k].prompt, [img], tok, proc_)
        first = group[0].multimodal["pixel_values"]
        for t in group:
            P = t.prompt_len
            assert t.input_ids[:P].tolist() == want.input_ids.tolist() == ds[k].input_ids
            np.testing.assert_array_equal(t.multimodal["pixel_values"], want.pixel_values.numpy())
            np.testing.assert_array_equal(
                t.multimodal["image_grid_thw"], want.image_grid_thw.numpy()
            )
            # encoded once for the group: the samples hold one array
            assert np.shares_memory(t.multimodal["pixel_values"], first)
            out = t.input_ids[P:].tolist()
            assert len(out) == 5 and not set(out) & banned
            assert (t.versions[P:] == 0).all() and (t.loss_mask[:P] == 0).all()
            assert t.validate() is t and vision_problem(t, spec) is None
        # greedy: the group's samples agree
        assert len({tuple(t.input_ids[t.prompt_len :].tolist()) for t in group}) == 1
        outputs.append(tuple(group[0].input_ids[group[0].prompt_len :].tolist()))
    # the prompts' texts are equal: different completions come from the images the server got
    assert len({ds[i].prompt for i in range(3)}) == 1
    assert len(set(outputs)) >= 2, outputs


def test_multi_turn_sends_the_images_with_every_turn(setup):
    """Two policy turns with an environment turn between: the second generation's input is the
    whole sequence so far, sent with the prompt's images again (the server refuses image
    placeholders without their images); the trajectory carries the group's encoding."""
    model, data, tok, _ = setup
    never = lambda prompt, completion, answer, **kw: 0.0  # noqa: E731 - always another turn
    wf = MultiTurnWorkflow(
        lambda: RetryEnvironment(never, feedback="="), 3, max_turns=2, max_total_tokens=200
    )
    ds, groups = _groups(setup, wf, n_groups=2)
    eq = tok("=", add_special_tokens=False)["input_ids"]
    for group in groups:
        k = int(group[0].meta["prompt_index"])
        for t in group:
            P = t.prompt_len
            assert t.meta["turns"] == 2 and t.input_ids[:P].tolist() == ds[k].input_ids
            # policy 3 tokens, environment "=", policy 3 tokens
            assert t.loss_mask[P:].tolist() == [1] * 3 + [0] * len(eq) + [1] * 3
            assert t.input_ids[P + 3 : P + 3 + len(eq)].tolist() == eq
            first = group[0].multimodal["pixel_values"]
            assert np.shares_memory(t.multimodal["pixel_values"], first)
            assert t.multimodal["pixel_values"].shape[0] == int(
                t.multimodal["image_grid_thw"].prod(-1).sum()
            )
