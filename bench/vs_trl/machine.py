"""bench/vs_trl's processes and machine: the CPU, each side's processes pinned to the same cores
with their peak memory, and their environment."""

import contextlib
import os
import subprocess
import time
from pathlib import Path

from bench.vs_trl.assets import ROOT


def cpu_info(cpus: list) -> dict:
    """CPU model name, the widest x86 vector ISA (avx512f / avx2 / neither), the bf16 matrix
    instructions (``bf16``: amx_bf16 / avx512_bf16 / none: what a bf16 matmul can use) and the
    cores."""
    text = Path("/proc/cpuinfo").read_text()
    model = next(
        (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
        "unknown",
    )
    flags = set(
        next(
            (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
        )
    )
    isa = (
        "avx512f"
        if "avx512f" in flags
        else "avx2 (no avx512f)"
        if "avx2" in flags
        else "neither avx2 nor avx512f"
    )
    bf16 = next((f for f in ("amx_bf16", "avx512_bf16") if f in flags), "none")
    return {"model": model, "isa": isa, "bf16": bf16, "cpus": cpus}


def _tree_pss_bytes(root: int) -> int:
    """The summed proportional set size (RSS where PSS is unreadable) of ``root`` and every
    process below it."""
    children = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            fields = dict(
                ln.split(":", 1)
                for ln in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
            )
            total += int(fields.get("Pss", fields.get("Rss", "0 kB")).split()[0]) * 1024
        except (OSError, ValueError):
            continue
    return total


def run_pinned(cmd: list, env: dict, log: Path, cpus: list, timeout: float) -> tuple:
    """Run ``cmd`` pinned to ``cpus`` (output to ``log``); returns ``(exit code, wall s, peak
    summed PSS bytes of its process tree)``, sampled every 5 s (each /proc scan costs CPU)."""
    t0, peak = time.time(), 0
    with open(log, "w") as f:
        proc = subprocess.Popen(
            [str(c) for c in cmd],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
            start_new_session=True,
            preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        )
        while proc.poll() is None:
            peak = max(peak, _tree_pss_bytes(proc.pid))
            if time.time() - t0 > timeout:
                os.killpg(proc.pid, 9)
                proc.wait()
                break
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
    return proc.returncode, time.time() - t0, peak


def _env(threads: int) -> dict:
    return dict(
        os.environ,
        CUDA_VISIBLE_DEVICES="",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS=str(threads),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        PYTHONWARNINGS="ignore",
    )
