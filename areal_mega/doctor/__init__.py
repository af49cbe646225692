"""``python -m areal_mega.doctor`` (``make doctor``): is this machine ready to run areal-mega?

One row per check, each pass / fail / skip with a key figure and, on failure, what to do:
Python and the pinned packages, the csrc kernels and the ISA / CUDA arch they run,
megatron-core's CPU patches, oneDNN, the logprob / GAE kernels against the torch reference;
then numbers on a tiny model: HF -> Megatron -> HF bit-exact, a CPU rollout server, two GRPO
steps through ``launch.local`` whose weight updates reach the server (its logprobs equal the
trainer's). With CUDA: CUDA kernels against the CPU ones, TransformerEngine and its attention
backend, an NCCL group of two processes, SGLang's version. The checks are functions of a
:class:`~areal_mega.doctor.rows.Context` (e.g. ``server_addr``: check a running server).

- :mod:`.rows` — a check, the row it produces, the shared context, the runner and the table;
- :mod:`.env_checks` — what is installed: Python, the pins, the kernels, the CPU patches,
  oneDNN;
- :mod:`.tiny_run` — the checks by numbers on a tiny model;
- :mod:`.cuda_checks` — the rows of a CUDA machine;
- ``__main__`` — the command line.
"""

from areal_mega.doctor.cuda_checks import CHECKS as CUDA_CHECKS
from areal_mega.doctor.env_checks import CHECKS as ENV_CHECKS
from areal_mega.doctor.rows import (
    Check,
    CheckFailed,
    CheckSkipped,
    Context,
    Row,
    format_table,
    new_context,
    run_checks,
)
from areal_mega.doctor.tiny_run import CHECKS as RUN_CHECKS

#: every check, in the order the doctor runs them
CHECKS = [*ENV_CHECKS, *RUN_CHECKS, *CUDA_CHECKS]

__all__ = [
    "CHECKS",
    "ENV_CHECKS",
    "RUN_CHECKS",
    "CUDA_CHECKS",
    "Check",
    "CheckFailed",
    "CheckSkipped",
    "Context",
    "Row",
    "format_table",
    "new_context",
    "run_checks",
    "select_checks",
]


def select_checks(names=None) -> list:
    """The checks called ``names`` (all when None) and those they need, in run order; raises
    ``ValueError`` naming an unknown check."""
    by_name = {c.name: c for c in CHECKS}
    if names is None:
        return list(CHECKS)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown check(s) {unknown}; checks: {', '.join(by_name)}")
    want, todo = set(), list(names)
    while todo:
        n = todo.pop()
        if n not in want:
            want.add(n)
            todo.extend(by_name[n].needs)
    return [c for c in CHECKS if c.name in want]
