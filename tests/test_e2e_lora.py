"""LoRA RL through ``launch.local`` (CPU, tiny model, CPU rollout servers).

Each published version reaches the servers as a PEFT adapter through SGLang's LoRA API
(``lora.sync=adapter``; the merged export, ``lora.sync=merged``, is checked against the adapter
model in tests/test_lora_peft_interop.py and by LoRA SFT below). With eta = 0 every token
after an update comes from the version just published, so a behaviour/proximal mismatch
<= 1e-5 on every step proves the servers generate with exactly the trainer's LoRA model. The
reference is the actor with its adapters off: KL 0 at first, then it grows. The
adapter run then resumes from its adapter-only checkpoint for one more step.
"""

import json

import pytest

from tests.helpers.local_runs import _finish, _launch, _metrics

pytestmark = pytest.mark.slow

LORA = [
    "lora.enabled=true",
    "lora.rank=8",
    "lora.alpha=16",
    "ref.enabled=true",
    "algorithm.kl_coef=0.01",
    "rollout.max_head_offpolicyness=0",
    "rollout.reward_fn=areal_mega.rewards:char_match_reward",
    "optimizer.lr=5e-3",
]


def _check_on_policy(rows):
    assert any(r.get("grad_norm", 0) > 0 for r in rows[:-1])  # the adapters moved
    for r in rows:
        assert r["mismatch_tokens"] > 0 and r["mismatch"] <= 1e-5, (r["step"], r["mismatch"])
    first = next(r for r in rows if "kl_ref" in r)
    assert first["kl_ref"] == 0.0 and rows[-1]["kl_ref"] > 0


@pytest.mark.timeout(600)
def test_lora_run_serves_the_trainers_model_and_resumes(assets, tmp_path):
    model, data = assets
    run = tmp_path / "run"
    rc, out = _finish(
        _launch(
            run, model, data, "total_steps=3", "recover=auto", "checkpoint.save_every=3", *LORA
        ),
        timeout=400,
    )
    assert rc == 0, out[-3000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    _check_on_policy(rows)
    published = sorted((run / "weights").iterdir())[-1]  # a PEFT adapter, not a model
    assert sorted(p.name for p in published.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    assert json.loads((published / "adapter_config.json").read_text())["r"] == 8
    # resume: the frozen base from model.path, the adapters and Adam from the checkpoint
    rc, out = _finish(
        _launch(
            run, model, data, "total_steps=4", "recover=auto", "checkpoint.save_every=4", *LORA
        ),
        timeout=400,
    )
    assert rc == 0, out[-3000:]
    assert "resumed from" in (run / "logs" / "trainer.log").read_text()
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["mismatch"] <= 1e-5 and rows[-1]["kl_ref"] > 0


@pytest.mark.timeout(300)
def test_lora_sft_exports_the_merged_model_and_its_adapter(assets, tmp_path):
    """LoRA SFT trains the adapters; its ``hf_model`` has them merged in and equals the base
    model with its ``adapter`` in ``peft``."""
    import os
    import subprocess
    import sys

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers.local_runs import ROOT

    model, data = assets
    run = tmp_path / "sft"
    from areal_mega.common.net import free_port

    env = dict(
        os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port())
    )  # not the default 29500 another test may hold
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "areal_mega.trainer",
            "--config",
            str(ROOT / "recipes" / "tiny-cpu.yaml"),
            "mode=sft",
            f"model.path={model}",
            f"data.train_path={data / 'train.jsonl'}",
            f"data.test_path={data / 'test.jsonl'}",
            f"logging.run_dir={run}",
            "logging.progress_bar=false",
            "logging.tensorboard=false",
            "total_steps=4",
            "optimizer.lr=1e-2",
            "optimizer.warmup_steps=0",
            "recover=off",
            "checkpoint.save_every=0",
            "lora.enabled=true",
            "lora.rank=4",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa
    ids = torch.tensor([[3, 5, 7, 9, 11, 4, 6, 8]])
    with torch.no_grad():
        merged = load(run / "hf_model")(input_ids=ids).logits
        peft = PeftModel.from_pretrained(load(model), run / "adapter")(input_ids=ids).logits
        base = load(model)(input_ids=ids).logits
    assert (merged - peft).abs().max() < 1e-4
    assert (merged - base).abs().max() > 1e-4  # the adapters trained
