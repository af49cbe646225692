"""A vision-language trainer's weights out of every layout: the engine's Qwen2.5-VL on the
converted checkpoint at one rank, TP2, PP2 and TP2+PP2 (Qwen3-VL, whose vision tower is
megatron layers split over TP too, at TP2 and PP2) exported through the production path
(``train.weights.export_hf_dir``: TP shards gathered, each pipeline stage its own shard, the
vision tower and projector from the first stage): every HF tensor of the source checkpoint,
bit for bit, and none more."""

import subprocess
import sys

import pytest
import torch

from areal_mega.models.tiny import make_tiny_model
from tests.helpers.workers import ROOT

LAYOUTS = {"one": 1, "tp2": 2, "pp2": 2, "tp2pp2": 4}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``arch -> (hf_dir, mcore_dir)``, made on first use: a tiny untied checkpoint (the
    output layer is the last stage's own tensor, lm_head.weight) and its conversion."""
    made = {}

    def get(arch):
        if arch not in made:
            base = tmp_path_factory.mktemp(f"vlw_{arch}")
            hf = make_tiny_model(
                base / "hf", arch=arch, charset="digits", tie_word_embeddings=False
            )
            out = base / "mcore"
            p = subprocess.run(
                [sys.executable, "tools/convert_hf_to_mcore.py", "--hf-dir", str(hf)]
                + ["--out", str(out)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert p.returncode == 0, p.stderr[-4000:]
            made[arch] = hf, out
        return made[arch]

    return get


CASES = [("qwen2_5_vl", layout) for layout in LAYOUTS] + [
    ("qwen3_vl", "tp2"),  # a tower of megatron layers: tensor-parallel itself
    ("qwen3_vl", "pp2"),
]


@pytest.mark.parametrize("arch,layout", CASES)
def test_export_at_every_layout_is_the_checkpoint_bit_for_bit(arch, layout, checkpoints, tmp_path):
    """The layout's export: the source checkpoint's names, each tensor bit for bit (the
    one-rank export included), one safetensors shard per pipeline stage."""
    from safetensors.torch import load_file

    from areal_mega.checkpoint.safetensors_io import SafetensorsDir
    from areal_mega.common.net import free_port
    from tests.helpers.multirank import run_ranks
    from tests.helpers.workers import worker_cmd

    hf_dir, mcore_dir = checkpoints(arch)
    world, port = LAYOUTS[layout], free_port()
    args = (layout, hf_dir, mcore_dir)
    ranks = run_ranks(
        [worker_cmd("vl_weights_worker", *args, r, world, port, tmp_path) for r in range(world)],
        timeout=400,
    )
    for r, (rc, out) in enumerate(ranks):
        assert rc == 0, f"rank {r} failed:\n" + out[-6000:]
    src = load_file(hf_dir / "model.safetensors")
    assert "lm_head.weight" in src and any("visual.merger." in k for k in src)
    got = SafetensorsDir(tmp_path / layout)
    assert sorted(got.keys()) == sorted(src)
    for k, t in src.items():
        g = got.get(k)
        assert g.dtype == t.dtype and g.shape == t.shape, k
        assert torch.equal(g.flatten().view(torch.uint8), t.flatten().view(torch.uint8)), k
    shards = sorted(p.name for p in (tmp_path / layout).glob("*.safetensors"))
    assert len(shards) == (2 if "pp2" in layout else 1), shards
