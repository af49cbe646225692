"""Images on the data plane (``Trajectory.multimodal``): the checks naming field and sample,
the checks against the receiving model (VisionSpec; a text model refuses images), the wire
(zero-copy frames, garbage refused while the receiver goes on over real sockets), the journal
and buffer files keeping the images, and the VisionSpec of the tiny Qwen2.5-VL."""

import json

import msgpack
import numpy as np
import pytest
import zmq

from areal_mega.dataplane import (
    Trajectory,
    TrajectoryBuffer,
    TrajectoryError,
    TrajectoryReceiver,
    TrajectorySender,
    VisionSpec,
    WireError,
    decode_trajectory,
    encode_trajectory,
)
from areal_mega.dataplane.journal import ReplayStats, TrajectoryJournal
from areal_mega.dataplane.multimodal import vision_problem
from tests.helpers.trajectories import make_traj
from tests.helpers.vl_trajectories import SPEC, make_vl_traj


def _set(key, value):
    def change(t):
        t.multimodal[key] = value

    return change


@pytest.mark.parametrize(
    "change, field, match",
    [
        (_set("pixel_values", np.ones((8, 12), np.float64)), "multimodal.pixel_values", "float64"),
        (_set("pixel_values", np.ones(96, np.float32)), "multimodal.pixel_values", "2-D"),
        (_set("image_grid_thw", np.ones((1, 3), np.int64)), "multimodal.image_grid_thw", "int64"),
        (_set("image_grid_thw", np.array([[1, 8]], np.int32)), "multimodal.image_grid_thw", "3"),
        (
            _set("image_grid_thw", np.array([[1, 0, 4]], np.int32)),
            "multimodal.image_grid_thw",
            "< 1",
        ),
        (_set("image_grid_thw", np.array([[1, 2, 2]], np.int32)), "multimodal.pixel_values", "= 4"),
        (
            _set("image_grid_thw", np.array([[2**20, 2**20, 2**20]], np.int32)),
            "multimodal.pixel_values",
            "8 patch rows",
        ),
        (
            lambda t: t.multimodal["pixel_values"].__setitem__((3, 1), np.nan),
            "multimodal.pixel_values",
            "finite",
        ),
        (
            lambda t: t.multimodal["pixel_values"].__setitem__((0, 0), np.inf),
            "multimodal.pixel_values",
            "finite",
        ),
        (lambda t: t.multimodal.pop("image_grid_thw"), "multimodal", "exactly"),
        (_set("video_grid_thw", np.ones((1, 3), np.int32)), "multimodal", "exactly"),
        (lambda t: setattr(t, "multimodal", [1]), "multimodal", "dict"),
        (
            lambda t: t.token_extras.__setitem__(
                "multimodal.pixel_values", np.zeros(t.length, np.float32)
            ),
            "token_extras.multimodal.pixel_values",
            "name",
        ),
    ],
)
def test_validate_names_the_field_and_sample(change, field, match):
    t = make_vl_traj(0)  # one image of 1x2x4 patches: 8 rows, 2 placeholders
    t.validate()
    change(t)
    with pytest.raises(TrajectoryError, match=match) as e:
        t.validate()
    assert e.value.field == field and e.value.sample_id == "vl-0"


def test_constructor_converts_and_text_samples_have_no_images():
    t = make_vl_traj(1, pixels=np.ones((8, 12)))  # float64 pixels become float32
    assert t.multimodal["pixel_values"].dtype == np.float32 and t.n_images == 1
    text = make_traj(1, 1)
    assert text.multimodal == {} and text.n_images == 0
    assert list(text.arrays()) == ["input_ids", "loss_mask", "logprobs", "versions", "reward"]
    back = Trajectory.from_dict(t.to_dict())
    assert back.equals(t) and back.token_extras == {}


def _moved_placeholder(t):
    """One placeholder moved from the prompt into the completion (count unchanged)."""
    ids = t.input_ids.copy()
    ids[int(np.flatnonzero(ids == SPEC.image_token_id)[0])] = 11
    ids[-1] = SPEC.image_token_id
    t.input_ids = ids


@pytest.mark.parametrize(
    "spec, change, match",
    [
        (None, None, "text-only"),
        (
            SPEC,
            lambda t: setattr(
                t, "input_ids", np.where(t.input_ids == 7, 11, t.input_ids).astype(np.int32)
            ),
            "hold 0 image placeholders",
        ),
        (VisionSpec(7, 2, 24, 4096, 8), None, "patch_dim 12"),
        (VisionSpec(7, 2, 12, 4, 8), None, "max_patches=4"),
        (VisionSpec(7, 2, 12, 4096, 1), lambda t: None, "max_images=1"),
        (VisionSpec(7, 4, 12, 4096, 8), None, "merge_size=4"),
        (SPEC, _moved_placeholder, "after the prompt"),
    ],
)
def test_checks_against_the_model(spec, change, match):
    t = make_vl_traj(
        2, grids=((1, 2, 4), (1, 2, 2)) if spec and spec.max_images == 1 else ((1, 2, 4),)
    )
    if change is not None:
        change(t)
    t.validate()
    field, problem = vision_problem(t, spec)
    assert field.startswith("multimodal") and match in problem, problem


def test_vision_model_accepts_text_and_refuses_loose_placeholders():
    text = make_traj(3, 3)
    text.input_ids = np.where(text.input_ids == SPEC.image_token_id, 8, text.input_ids).astype(
        np.int32
    )
    assert vision_problem(text, SPEC) is None and vision_problem(text, None) is None
    assert vision_problem(make_vl_traj(4, grids=((1, 2, 4), (2, 4, 2))), SPEC) is None
    stray = make_vl_traj(5, grids=())
    stray.input_ids[2] = SPEC.image_token_id
    assert "carries no images" in vision_problem(stray, SPEC)[1]
    ok = make_vl_traj(6)
    ok.versions[2] = 0  # a placeholder with a version: generated, not a prompt token
    assert "versions -1" in vision_problem(ok, SPEC)[1]


def test_wire_round_trip_is_zero_copy_for_big_pixels():
    big = make_vl_traj(7, grids=((1, 16, 16), (1, 8, 4)))  # 288 x 12 float32 = 13.8 KB
    frames = encode_trajectory(big, pack_threshold=1024)
    # the pixels are a frame of their own, the sender's own memory (no copy)
    assert any(
        isinstance(f, np.ndarray) and np.shares_memory(f, big.multimodal["pixel_values"])
        for f in frames
    )
    wire = [bytes(memoryview(f)) for f in frames]
    back = decode_trajectory(wire)
    assert back.equals(big) and back.n_images == 2
    pv = back.multimodal["pixel_values"]
    assert not pv.flags.writeable and pv.base is not None  # a view on the received frame
    small = make_vl_traj(8)
    assert decode_trajectory([bytes(memoryview(f)) for f in encode_trajectory(small)]).equals(small)


def _vl_garbage():
    """(reason, frames) of malformed messages with images."""
    good = make_vl_traj(9, grids=((1, 4, 4),))
    fr = [bytes(memoryview(f)) for f in encode_trajectory(good, pack_threshold=256)]
    h = msgpack.unpackb(fr[0])
    names = [f[0] for f in h["fields"]]
    own = [f[0] for f in h["fields"] if not f[3]]
    k_pix = 2 + own.index("multimodal.pixel_values")
    i_pix, i_grid = names.index("multimodal.pixel_values"), names.index("multimodal.image_grid_thw")

    def with_header(mutate, frames=fr):
        hh = msgpack.unpackb(msgpack.packb(h))
        mutate(hh)
        return [msgpack.packb(hh, use_bin_type=True)] + frames[1:]

    def with_frame(k, data):
        return fr[:k] + [data] + fr[k + 1 :]

    pix = np.frombuffer(fr[k_pix], np.float32)
    nan = pix.copy()
    nan[5] = np.nan
    out = [
        # the same bytes declared as another dtype / shape
        ("bad_dtype", with_header(lambda hh: hh["fields"][i_pix].__setitem__(1, "<i4"))),
        (
            "bad_dtype",
            with_header(
                lambda hh: (
                    hh["fields"][i_pix].__setitem__(1, "<f8")
                    or hh["fields"][i_pix].__setitem__(2, [8, 12])
                )
            ),
        ),
        ("invalid_field", with_header(lambda hh: hh["fields"][i_pix].__setitem__(2, [12, 16]))),
        ("invalid_field", with_header(lambda hh: hh["fields"][i_pix].__setitem__(2, [192]))),
        ("frame_size", with_header(lambda hh: hh["fields"][i_pix].__setitem__(2, [15, 12]))),
        ("frame_size", with_frame(k_pix, fr[k_pix][:-4])),  # truncated pixels
        ("frame_count", fr[:-1]),
        ("invalid_field", with_frame(k_pix, nan.tobytes())),  # NaN pixel
        ("bad_shape", with_header(lambda hh: hh["fields"][i_grid].__setitem__(2, [1, 3, 1, 1, 1]))),
    ]
    return good, out


def test_decoder_refuses_garbage_images_naming_the_reason():
    good, garbage = _vl_garbage()
    for reason, frames in garbage:
        with pytest.raises(WireError) as e:
            decode_trajectory(frames)
        assert e.value.reason == reason, (reason, e.value)
    assert decode_trajectory(
        [bytes(memoryview(f)) for f in encode_trajectory(good, pack_threshold=256)]
    ).equals(good)


def test_receivers_refuse_garbage_and_images_they_cannot_see_and_go_on():
    """Real sockets: a VL receiver drops the garbage (and a sample whose placeholders do not
    match its images) and accepts every good sample, text or with images; a text receiver
    refuses the samples with images under invalid_field and accepts the text ones."""
    good, garbage = _vl_garbage()
    bad_tokens = make_vl_traj(10, sample_id="bad-tokens")
    bad_tokens.input_ids[np.flatnonzero(bad_tokens.input_ids == 7)[0]] = 12
    with TrajectoryReceiver("tcp://127.0.0.1:*", vision=SPEC) as rx:
        raw = zmq.Context.instance().socket(zmq.DEALER)
        raw.connect(rx.endpoint)
        want = []
        with TrajectorySender(rx.endpoint) as tx:
            for k, (_, frames) in enumerate(garbage):
                raw.send_multipart(frames)
                t = make_vl_traj(100 + k, grids=((1, 2, 2),) * (k % 3))
                tx.send(t)
                want.append(t)
            tx.send(bad_tokens)
            got = [rx.recv(timeout=30) for _ in want]
            assert rx.recv(timeout=0.5) is None
        raw.close(0)
        assert [t.sample_id for t in got] == [t.sample_id for t in want]
        assert all(a.equals(b) for a, b in zip(got, want))
        expected = {}
        for reason, _ in garbage:
            expected[reason] = expected.get(reason, 0) + 1
        expected["invalid_field"] += 1  # bad_tokens
        assert dict(rx.rejected) == expected
    with TrajectoryReceiver("tcp://127.0.0.1:*") as text_rx:  # vision=None: a text model
        with TrajectorySender(text_rx.endpoint) as tx:
            tx.send(good)
            tx.send(make_traj(1, 2))
            got = text_rx.recv(timeout=30)
            assert got.sample_id == "w1-2" and text_rx.recv(timeout=0.5) is None
        assert dict(text_rx.rejected) == {"invalid_field": 1}


def test_journal_and_buffer_files_keep_the_images(tmp_path):
    trajs = [make_vl_traj(20 + k, grids=((1, 2, 2),) * k, group_id="g0") for k in range(3)]
    trajs.append(make_traj(2, 4))
    j = TrajectoryJournal(tmp_path / "journal")
    j.append(trajs)
    j.close()
    stats = ReplayStats()
    back = list(TrajectoryJournal.replay(tmp_path / "journal", stats))
    assert len(back) == 4 and all(a.equals(b) for a, b in zip(back, trajs))
    assert stats.corrupt == 0
    buf = TrajectoryBuffer(group_size=3)
    for t in trajs[:3]:
        buf.put(t)
    buf.save(str(tmp_path / "buffer.bin"))
    loaded = TrajectoryBuffer.load(str(tmp_path / "buffer.bin"))
    (group,) = loaded.get_groups(1)
    assert sorted(t.sample_id for t in group) == sorted(t.sample_id for t in trajs[:3])
    by_id = {t.sample_id: t for t in trajs}
    assert all(t.equals(by_id[t.sample_id]) for t in group)


def test_vision_spec_of_the_tiny_qwen25_vl(tmp_path):
    from areal_mega.models.tiny import make_tiny_model
    from areal_mega.models.vlm.config import vision_spec
    from areal_mega.models.vlm.inputs import encode_sample, load_image_processor

    d = make_tiny_model(tmp_path / "hf", arch="qwen2_5_vl", charset="digits")
    hf = json.loads((d / "config.json").read_text())
    spec = vision_spec(hf, max_patches=64, max_images=2)
    assert spec == VisionSpec(hf["image_token_id"], 2, 3 * 2 * 14 * 14, 64, 2)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    proc = load_image_processor(d)
    img = np.random.default_rng(0).integers(0, 256, (56, 28, 3), dtype=np.uint8)
    s = encode_sample("<|vision_start|><|image_pad|><|vision_end|>1+2=", [img], tok, proc)
    t = Trajectory.from_tokens(
        s.input_ids,
        [5, 6],
        [-0.5, -0.5],
        [0, 0],
        sample_id="real",
        multimodal={"pixel_values": s.pixel_values, "image_grid_thw": s.image_grid_thw},
    ).validate()
    assert t.multimodal["image_grid_thw"].dtype == np.int32
    assert vision_problem(t, spec) is None
    assert "max_patches=4" in vision_problem(t, vision_spec(hf, max_patches=4))[1]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_the_language_model_arch_of_each_vl_family(arch):
    """What the engine reads around a VL model (its language model's sizes): Qwen2.5-VL's has
    a QKV bias and hidden/heads heads; Qwen3-VL's is Qwen3's (QK norms, no QKV bias) with its
    own head_dim (24 here, not hidden/heads = 16)."""
    from areal_mega.models.tiny import TinyModelSpec
    from areal_mega.models.vlm.config import vl_text_arch
    from areal_mega.models.vlm.tiny import tiny_qwen3_vl_config, tiny_qwen25_vl_config

    qwen3 = arch == "qwen3_vl"
    spec = TinyModelSpec(arch=arch, head_dim=24 if qwen3 else None)
    make = tiny_qwen3_vl_config if qwen3 else tiny_qwen25_vl_config
    hf = make(spec, 107, 0, 1).to_dict()
    a = vl_text_arch(hf)
    assert (a.model_type, a.vocab_size, a.hidden_size, a.num_layers) == (arch, 107, 64, 2)
    assert (a.head_dim, a.qkv_bias, a.qk_norm) == (
        (24, False, True) if qwen3 else (16, True, False)
    )
    assert json.loads(a.hf_json)["model_type"] == arch


def test_the_trainer_takes_as_many_images_as_the_dataset_allows():
    """``data.images.max_images`` above the receiver's default raises the trainer's limit too
    (the CPU server gets it as --max-images: tests/test_launch_plan.py)."""
    from areal_mega.config import load_config
    from areal_mega.models.tiny import TinyModelSpec
    from areal_mega.models.vlm.config import DEFAULT_MAX_IMAGES
    from areal_mega.models.vlm.tiny import tiny_qwen25_vl_config
    from areal_mega.train.teacher import vision_of
    from tests.helpers.workers import ROOT

    hf = tiny_qwen25_vl_config(TinyModelSpec(arch="qwen2_5_vl"), 107, 0, 1).to_dict()
    recipe = ROOT / "recipes" / "tiny-vl-cpu.yaml"
    assert vision_of(load_config(recipe), hf).max_images == DEFAULT_MAX_IMAGES
    many = load_config(recipe, [f"data.images.max_images={DEFAULT_MAX_IMAGES + 36}"])
    assert vision_of(many, hf).max_images == DEFAULT_MAX_IMAGES + 36
