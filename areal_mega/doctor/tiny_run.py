"""The doctor's checks by numbers on a tiny model: HF -> Megatron -> HF conversion bit-exact,
one CPU rollout server answering with logprobs, two GRPO steps through ``launch.local``
against that server, and the server's logprobs after the trainer's weight update equal to
the trainer's own (``mismatch``, measured by the trainer on the server's tokens)."""

from __future__ import annotations

import json
import math
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import List

from areal_mega.data.synthetic import write_task_files
from areal_mega.doctor.rows import Check, CheckFailed, Context
from areal_mega.inference.process import LocalServerProcess
from areal_mega.models.tiny import make_tiny_model

#: the tiny model of every run check (the demo's digits vocabulary, ~0.1M parameters)
MODEL = dict(
    arch="llama",
    charset="digits",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    seed=1,
)
#: the largest mean |server logprob - trainer logprob| over tokens both computed with the same
#: weights (the fp32 on-policy bound tests/test_e2e_async_rl.py holds the trainer to)
MISMATCH_TOL = 1e-5
RL_STEPS = 2
RECIPE = Path("recipes") / "tiny-cpu.yaml"


def doctor_model(ctx: Context) -> Path:
    """The tiny HF model the run checks use: ``ctx.model_dir``, or one built under the work
    directory (once)."""
    if ctx.model_dir is None:
        ctx.model_dir = make_tiny_model(ctx.work / "model", **MODEL)
    return Path(ctx.model_dir)


def _tensors(d: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def byte_mismatches(a: dict, b: dict) -> List[str]:
    """Names of tensors missing on one side or differing in dtype, shape or any byte."""
    import torch

    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        ):
            bad.append(k)
    return bad


def check_convert(ctx: Context) -> str:
    """The tiny model HF -> Megatron dist-checkpoint -> HF, every tensor byte-equal."""
    from areal_mega.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf

    hf = doctor_model(ctx)
    out = ctx.work / "convert"
    convert_hf_to_mcore(hf, out / "mcore", progress=False)
    convert_mcore_to_hf(out / "mcore", out / "hf", progress=False)
    src, back = _tensors(hf), _tensors(out / "hf")
    bad = byte_mismatches(src, back)
    if bad or not src:
        raise CheckFailed(
            f"{len(bad)} of {len(src)} tensors differ after HF -> Megatron -> HF: {bad[:4]}"
        )
    return f"{len(src)} tensors of the tiny {MODEL['arch']} model bit-exact after the round trip"


def http_json(addr: str, path: str, body=None, timeout: float = 60.0) -> dict:
    """``GET`` (or ``POST`` with ``body``) ``http://addr/path`` and decode the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://{addr}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _prompt_ids(model: Path) -> List[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)("12345=", add_special_tokens=False)["input_ids"]


def check_rollout_server(ctx: Context) -> str:
    """Start a CPU rollout server on the tiny model (or use ``ctx.server_addr``) and sample
    4 tokens with logprobs from it."""
    model = doctor_model(ctx)
    t0, started = time.monotonic(), ctx.server_addr is None
    if started:
        srv = LocalServerProcess(str(model), log_path=str(ctx.work / "server.log"))
        ctx.cleanups.append(srv.stop)
        try:
            srv.wait_ready(120)
        except (RuntimeError, TimeoutError) as e:
            raise CheckFailed(f"{e} (log: {ctx.work / 'server.log'})") from None
        ctx.server_addr = srv.addr
    addr = ctx.server_addr
    out = http_json(
        addr,
        "/generate",
        {
            "input_ids": _prompt_ids(model),
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True},
        },
    )
    lps = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
    if (
        len(out["output_ids"]) != 4
        or len(lps) != 4
        or not all(isinstance(x, float) and math.isfinite(x) and x <= 0 for x in lps)
    ):
        raise CheckFailed(
            f"/generate on {addr} answered {len(out['output_ids'])} tokens with logprobs {lps}"
        )
    how = f"started in {time.monotonic() - t0:.1f} s" if started else "given"
    return f"CPU server on {addr} ({how}): 4 tokens, logprobs {min(lps):.2f}..{max(lps):.2f}"


def rl_command(ctx: Context, run_dir: Path, data: Path) -> list:
    """``launch.local`` for :data:`RL_STEPS` synchronous GRPO steps (η = 0, weights on disk,
    no warm-up so step 1 moves them) against the server of the ``rollout-server`` check."""
    return [
        ctx.python,
        "-m",
        "areal_mega.launch.local",
        "--config",
        str(ctx.root / RECIPE),
        f"model.path={doctor_model(ctx)}",
        f"data.train_path={data / 'train.jsonl'}",
        f"data.test_path={data / 'test.jsonl'}",
        f"logging.run_dir={run_dir}",
        "allocation=megatron:d1",
        f"rollout.server_addrs={ctx.server_addr}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        # 8 samples a group: step 1 moves the weights unless every group's rewards are
        # equal (with 4, an untrained model's all-zero groups made that happen now and then)
        "rollout.batch_size=4",
        "rollout.n_samples=8",
        f"total_steps={RL_STEPS}",
        "recover=off",
        "rollout.max_head_offpolicyness=0",
        "rollout.weight_update=disk",
        "checkpoint.save_every=0",
        "optimizer.warmup_steps=0",
        "optimizer.lr=1e-3",
        "rollout.reward_fn=areal_mega.rewards:char_match_reward",
        "seed=1",
    ]


def check_rl_step(ctx: Context) -> str:
    """Run :data:`RL_STEPS` GRPO steps through ``launch.local`` against the server; keep
    their metrics for ``weight-update``."""
    if not (ctx.root / RECIPE).is_file():
        raise CheckFailed(f"{ctx.root / RECIPE} not found: run the doctor from a checkout")
    data = ctx.work / "data"
    write_task_files(data, task="reverse", n_train=64, n_test=8, seed=1)
    run_dir, log = ctx.work / "rl", ctx.work / "rl.log"
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                rl_command(ctx, run_dir, data),
                cwd=ctx.root,
                env=ctx.env(CUDA_VISIBLE_DEVICES=""),
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=240,
            ).returncode
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"launch.local did not finish in 240 s (log: {log})") from None
    metrics = run_dir / "metrics.jsonl"
    rows = (
        [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        if metrics.exists()
        else []
    )
    rows = [r for r in rows if r.get("step", 0) >= 1]
    if rc != 0 or [r["step"] for r in rows] != list(range(1, RL_STEPS + 1)):
        raise CheckFailed(
            f"launch.local exit {rc}, steps {[r['step'] for r in rows]} (log: {log};"
            f" {run_dir / 'logs'})"
        )
    if not all(math.isfinite(r.get("loss", float("nan"))) for r in rows):
        raise CheckFailed(f"non-finite loss: {[r.get('loss') for r in rows]} (log: {log})")
    ctx.state["rl_rows"], ctx.state["rl_dir"] = rows, run_dir
    return (
        f"{RL_STEPS} GRPO steps via launch.local in {time.monotonic() - t0:.0f} s, "
        f"loss {rows[0]['loss']:.3f} -> {rows[-1]['loss']:.3f}"
    )


def check_weight_update(ctx: Context) -> str:
    """The RL run's weights reached the server: step 1 moved them, step 2 trained only
    tokens of version 1, the server reports the last version, and the trainer's logprobs of
    the server's tokens equal the server's (``mismatch``)."""
    if "rl_rows" not in ctx.state:
        raise CheckFailed(
            "no RL run to read: the rl-step check did not run before this one",
            "run the rl-step check first (select_checks adds it)",
        )
    rows, run_dir = ctx.state["rl_rows"], ctx.state["rl_dir"]
    first, last = rows[0], rows[-1]
    if not (first.get("lr", 0) > 0 and first.get("grad_norm", 0) > 0):
        raise CheckFailed(
            f"step 1 did not move the weights (lr {first.get('lr')}, grad_norm "
            f"{first.get('grad_norm')}): nothing to compare",
            "see the RL run's trainer log",
        )
    v = RL_STEPS - 1
    if (last.get("versions/min"), last.get("versions/max")) != (v, v) or not last.get(
        "mismatch_tokens"
    ):
        raise CheckFailed(
            f"step {RL_STEPS} trained tokens of versions {last.get('versions/min')}"
            f"..{last.get('versions/max')}, expected all of version {v} "
            "(the server did not serve the published weights)"
        )
    info = http_json(ctx.server_addr, "/get_server_info")
    if str(info.get("weight_version")) != str(RL_STEPS):
        raise CheckFailed(
            f"the server reports weight version {info.get('weight_version')!r}, "
            f"expected {RL_STEPS} after {RL_STEPS} published updates"
        )
    mism, n = last["mismatch"], int(last["mismatch_tokens"])
    # undefined (left out of the row) when step 1 had no token of the trainer's version
    step1 = f"{first['mismatch']:.2e}" if "mismatch" in first else "not measured"
    if not mism <= MISMATCH_TOL:
        raise CheckFailed(
            f"server logprobs differ from the trainer's by {mism:.2e} (mean |diff| over {n} "
            f"tokens generated after update {v}; step 1: {step1}; "
            f"tolerance {MISMATCH_TOL:.0e}; server {ctx.server_addr})",
            "the server does not compute the trainer's model: check that it was started from "
            "the trainer's model (config.json: architecture, norm eps, rope) and that weight "
            f"updates reach it (its log; the RL run in {run_dir})",
        )
    return (
        f"published v1..v{RL_STEPS} to {ctx.server_addr}; after v{v} its logprobs = "
        f"trainer's to {mism:.1e} (mean over {n} tokens)"
    )


CHECKS = [
    Check(
        "convert",
        "tiny model HF -> Megatron -> HF bit-exact",
        "run tests/test_convert_roundtrip.py",
        check_convert,
        needs=("megatron-patches",),
    ),
    Check(
        "rollout-server",
        "one CPU rollout server started, /generate with logprobs",
        "see the server log in the work directory",
        check_rollout_server,
    ),
    Check(
        "rl-step",
        f"{RL_STEPS} GRPO steps (launch.local, trainer + rollout worker)",
        "see the RL run's logs in the work directory",
        check_rl_step,
        needs=("megatron-patches", "rollout-server"),
    ),
    Check(
        "weight-update",
        "weights published; server logprobs = trainer's",
        "see the RL run's logs in the work directory",
        check_weight_update,
        needs=("rl-step",),
    ),
]
