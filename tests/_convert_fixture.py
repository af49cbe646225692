"""Shared by the conversion/checkpoint tests: run tests/_convert_jobs.py once per session."""
import json
import socket
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def run_jobs(base: Path) -> Path:
    """Convert every tiny-model variant HF -> megatron -> HF (once; cached under ``base``)."""
    work = base / "convert_jobs"
    if not (work / "results.json").exists():
        p = subprocess.run([sys.executable, str(TESTS / "_convert_jobs.py"), str(work)],
                           cwd=ROOT, capture_output=True, text=True, timeout=400)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    return work


def results(work: Path) -> dict:
    return json.loads((work / "results.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_2ranks(scenario: str, work: Path, conv: Path, timeout: float = 300) -> list:
    """Run the 2-rank worker for ``scenario``; returns both ranks' result dicts."""
    port = free_port()
    work.mkdir(parents=True, exist_ok=True)
    procs = [subprocess.Popen([sys.executable, str(TESTS / "_mp_checkpoint_worker.py"), str(r),
                               "2", str(port), str(work), scenario, str(conv)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n" + outs[r][-6000:]
    return [json.loads((work / f"{scenario}_rank{r}.json").read_text()) for r in range(2)]
