"""One-command validation on a machine with one CUDA GPU and no internet (``make gpu-check``).

Assumes ``python3`` has torch with CUDA and our pure-Python dependencies (``make gpu-wheels``
on a connected machine brings them as wheels in ``.whl/``); needs neither TransformerEngine nor
SGLang (tests that need them skip themselves). Steps, each a subprocess:

1. ``build``       -- ``setup.py build_ext --inplace``; the CUDA kernels must import;
2. ``doctor``      -- ``python -m areal_mega.doctor`` (``make doctor``): every row, the CUDA
   ones included (CUDA kernels = CPU kernels, TransformerEngine, NCCL, SGLang); fails
   naming the failed rows;
3. ``gpu-tests``   -- ``pytest -m gpu`` (native kernels required), passed/skipped counts;
4. ``kernel-bench``-- ``bench/kernels.py --device cuda``: copy bandwidth and the logprob/GAE
   kernels' achieved bandwidth as a fraction of it;
5. ``prepare``     -- the CPU demo's tiny model and task files (``areal_mega.demo`` pieces);
6. ``train-bf16``  -- ``areal_mega.trainer`` (the production trainer entry point, SFT mode) for
   a few bf16 steps on the GPU;
7. ``e2e-rl``      -- a short asynchronous GRPO run (production PPO loss) through
   ``launch.local`` on the GPU, bf16, against the CPU-protocol local rollout server
   (``areal_mega.inference.server``) started beside it as an external server.

Then one table: step, pass/fail/skip, seconds, key figure. Exit status 0 only when no step
failed. Without CUDA it stops at once with a message (exit 2); ``--dry-run`` lists the steps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from areal_mega.common.net import free_port, tcp_ready  # noqa: E402  (tools/ is sys.path[0])

RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
NO_CUDA_MSG = (
    "gpu_check: torch ({torch}) sees no CUDA device. This check needs one CUDA GPU "
    "and torch built with CUDA (python: {python}). Use --dry-run to list the steps."
)


class Step:
    """One check: a name, how to run it and how to read its key figure."""

    def __init__(self, name: str, describe: str, run: Callable[["Step", Path], None]):
        self.name, self.describe, self._run = name, describe, run
        self.status, self.seconds, self.figure, self.log = "skip", 0.0, "", None

    def execute(self, work: Path) -> None:
        """Run the step, recording pass/fail, seconds and the key figure (never raises)."""
        t0 = time.time()
        try:
            self._run(self, work)
            self.status = "pass"
        except StepFailed as e:
            self.status, self.figure = "fail", str(e)
        except Exception as e:  # noqa: BLE001 - one step's crash must not hide the others
            self.status, self.figure = "fail", f"{type(e).__name__}: {e}"
        self.seconds = time.time() - t0


class StepFailed(RuntimeError):
    """A step's command failed; the message is the table's key figure."""


def run_logged(
    cmd: List[str], log: Path, *, env: Optional[dict] = None, timeout: float = 1800
) -> str:
    """Run ``cmd`` from the repository root with output in ``log``; return the output,
    raising :class:`StepFailed` (naming the log) on a nonzero exit."""
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **(env or {}))
    with open(log, "w") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        try:
            rc = subprocess.run(
                [str(c) for c in cmd],
                cwd=ROOT,
                env=full_env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            raise StepFailed(f"timed out after {timeout:.0f} s (log: {log})") from None
    out = log.read_text(errors="replace")
    if rc != 0:
        tail = [ln for ln in out.strip().splitlines() if ln.strip()][-1:] or [""]
        raise StepFailed(f"exit {rc}: {tail[0][:80]} (log: {log})")
    return out


# ------------------------------------------------------------------------------------ steps
def step_build(step: Step, work: Path) -> None:
    run_logged(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        work / "build.log",
        env={"MAX_JOBS": os.environ.get("MAX_JOBS", "8")},
    )
    out = run_logged(
        [
            sys.executable,
            "-c",
            "import torch, areal_mega._ops_cuda; print(torch.cuda.get_device_capability())",
        ],
        work / "build_import.log",
    )
    step.figure = f"_ops_cuda imports (capability {out.strip().splitlines()[-1]})"


def step_doctor(step: Step, work: Path) -> None:
    report_path = work / "doctor.json"
    error = None
    try:
        run_logged(
            [
                sys.executable,
                "-m",
                "areal_mega.doctor",
                "--json-out",
                report_path,
                "--work",
                work / "doctor",
            ],
            work / "doctor.log",
        )
    except StepFailed as e:
        error = e
    rows = json.loads(report_path.read_text())["rows"] if report_path.exists() else []
    failed = [r["name"] for r in rows if r["status"] == "fail"]
    if failed:
        raise StepFailed(f"failed rows: {', '.join(failed)} (log: {work / 'doctor.log'})")
    if error is not None:
        raise error
    skipped = [r["name"] for r in rows if r["status"] == "skip"]
    step.figure = f"{len(rows)} rows pass" + (f", skipped: {', '.join(skipped)}" if skipped else "")


def step_gpu_tests(step: Step, work: Path) -> None:
    out = run_logged(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"],
        work / "gpu_tests.log",
        env={"AREAL_MEGA_OPS_BACKEND": "native"},
        timeout=3600,
    )
    counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", out))
    step.figure = ", ".join(f"{v} {k}" for k, v in counts.items()) or "no summary line"


def step_bench(step: Step, work: Path) -> None:
    res_path = work / "kernels.json"
    run_logged(
        [sys.executable, "bench/kernels.py", "--device", "cuda", "--json-out", res_path],
        work / "kernels.log",
    )
    r = json.loads(res_path.read_text())
    step.figure = (
        f"copy {r['copy_gbps']:.0f} GB/s; logprob {r['logprob_fraction']:.2f}, "
        f"GAE {r['gae_fraction']:.2f} of it"
    )


def step_prepare(step: Step, work: Path) -> None:
    code = (
        "import sys; from areal_mega.demo import MODEL; "
        "from areal_mega.models.tiny import make_tiny_model; "
        "from areal_mega.data.synthetic import write_task_files; "
        "w = sys.argv[1]; make_tiny_model(w + '/base_model', seed=1, **MODEL); "
        "write_task_files(w + '/data', task='reverse', seed=1)"
    )
    run_logged(
        [sys.executable, "-c", code, work], work / "prepare.log", env={"CUDA_VISIBLE_DEVICES": ""}
    )
    step.figure = f"tiny model + task files under {work}"


def _common(work: Path) -> List[str]:
    return [
        "cluster.device=cuda",
        "cluster.n_gpus_per_node=1",
        "model.dtype=bf16",
        f"data.train_path={work / 'data' / 'train.jsonl'}",
        f"data.test_path={work / 'data' / 'test.jsonl'}",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
        "logging.plot=false",
        "recover=off",
        "seed=1",
    ]


def _last_metrics(path: Path) -> List[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def step_train(step: Step, work: Path) -> None:
    run_dir = work / "sft"
    run_logged(
        [
            sys.executable,
            "-m",
            "areal_mega.trainer",
            "--config",
            RECIPE,
            "mode=sft",
            f"model.path={work / 'base_model'}",
            f"logging.run_dir={run_dir}",
            "total_steps=5",
            "optimizer.lr=1e-3",
            "optimizer.warmup_steps=0",
            "checkpoint.save_every=0",
            *_common(work),
        ],
        work / "train_bf16.log",
        env={
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "AREAL_MEGA_OPS_BACKEND": "native",
        },
    )
    rows = _last_metrics(run_dir / "metrics.jsonl")
    if not rows:
        raise StepFailed(f"no metrics in {run_dir / 'metrics.jsonl'}")
    loss = [r.get("loss") for r in rows if r.get("loss") is not None]
    step.figure = (
        f"{len(rows)} bf16 steps, loss {loss[0]:.3f} -> {loss[-1]:.3f}"
        if loss
        else f"{len(rows)} bf16 steps"
    )


def step_e2e(step: Step, work: Path) -> None:
    model = work / "sft" / "hf_model"
    if not (model / "config.json").exists():
        model = work / "base_model"
    port = free_port()
    server_log = open(work / "e2e_server.log", "w")
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "areal_mega.inference.server",
            "--model-path",
            str(model),
            "--port",
            str(port),
        ],
        cwd=ROOT,
        stdout=server_log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        deadline, ready = time.time() + 180, tcp_ready("127.0.0.1", port)
        while time.time() < deadline and server.poll() is None:
            if ready():
                break
            time.sleep(0.5)
        else:
            raise StepFailed(f"local rollout server did not start (log: {server_log.name})")
        run_dir = work / "rl"
        run_logged(
            [
                sys.executable,
                "-m",
                "areal_mega.launch.local",
                "--config",
                RECIPE,
                f"model.path={model}",
                f"logging.run_dir={run_dir}",
                "total_steps=6",
                "allocation=megatron:d1",
                f"rollout.server_addrs=127.0.0.1:{port}",
                "checkpoint.save_every=0",
                *_common(work),
            ],
            work / "e2e_rl.log",
            env={"AREAL_MEGA_OPS_BACKEND": "native"},
        )
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        server_log.close()
    rows = _last_metrics(work / "rl" / "metrics.jsonl")
    if not rows:
        raise StepFailed(f"no metrics in {work / 'rl' / 'metrics.jsonl'}")
    rew = [r.get("reward/mean", float("nan")) for r in rows]
    kl = rows[0].get("ppo_kl", rows[0].get("actor/ppo_kl"))
    step.figure = f"{len(rows)} RL steps, reward {rew[0]:.2f} -> {rew[-1]:.2f}" + (
        f", first ppo_kl {kl:.1e}" if isinstance(kl, (int, float)) else ""
    )


STEPS = [
    ("build", "setup.py build_ext --inplace; import areal_mega._ops_cuda", step_build),
    ("doctor", "python -m areal_mega.doctor (every row, CUDA rows included)", step_doctor),
    ("gpu-tests", "pytest -m gpu (AREAL_MEGA_OPS_BACKEND=native)", step_gpu_tests),
    ("kernel-bench", "bench/kernels.py --device cuda (fraction of copy bandwidth)", step_bench),
    ("prepare", "tiny model + task files (areal_mega.demo pieces, CPU)", step_prepare),
    ("train-bf16", "areal_mega.trainer mode=sft, bf16 on cuda, 5 steps", step_train),
    ("e2e-rl", "launch.local GRPO, bf16 on cuda, local rollout server, 6 steps", step_e2e),
]


def format_table(steps: List[Step]) -> str:
    """The summary table (one row per step)."""
    rows = [("step", "result", "seconds", "key figure")]
    rows += [(s.name, s.status.upper(), f"{s.seconds:.1f}", s.figure) for s in steps]
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]}" for r in rows]
    lines.insert(1, "-" * max(len(ln) for ln in lines))
    return "\n".join(lines)


def cuda_problem() -> Optional[str]:
    """``None`` when torch sees a CUDA device, else the message to exit with."""
    try:
        import torch
    except ImportError:
        return NO_CUDA_MSG.format(torch="not importable", python=sys.executable)
    if torch.version.cuda is None or not torch.cuda.is_available():
        return NO_CUDA_MSG.format(
            torch=f"{torch.__version__}, CUDA {torch.version.cuda}", python=sys.executable
        )
    return None


def main(argv=None) -> int:
    """Run the checks (or list them) and print the table; returns the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", default=None, help="output directory (default runs/gpu-check-<time>)")
    p.add_argument("--only", default=None, help="comma-separated step names to run")
    p.add_argument("--dry-run", action="store_true", help="list the steps and exit")
    args = p.parse_args(argv)
    names = [n for n, _, _ in STEPS]
    chosen = names if not args.only else [n.strip() for n in args.only.split(",")]
    bad = [n for n in chosen if n not in names]
    if bad:
        p.error(f"--only: unknown step(s) {bad}; steps: {', '.join(names)}")
    if args.dry_run:
        for n, d, _ in STEPS:
            print(f"{n:13s} {'' if n in chosen else '(not selected) '}{d}")
        return 0
    problem = cuda_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    work = Path(args.work or ROOT / "runs" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}")
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    steps = [Step(n, d, fn) for n, d, fn in STEPS if n in chosen]
    for s in steps:
        print(f"[gpu-check] {s.name}: {s.describe}", flush=True)
        s.execute(work)
        print(f"[gpu-check] {s.name}: {s.status} in {s.seconds:.1f} s  {s.figure}", flush=True)
    print("\n" + format_table(steps))
    print(f"\nlogs: {work}")
    return 1 if any(s.status == "fail" for s in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
