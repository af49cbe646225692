"""glibc's malloc policies (areal_mega/common/malloc.py), each in a fresh process: where a
large tensor's buffer lives, and whether allocating it again, round after round, faults its
pages in."""

import json
import subprocess
import sys

import pytest

from areal_mega.common import malloc

PROBE = r"""
import json, resource, sys
import torch
from areal_mega.common import malloc

ROUNDS = 24
took = malloc.set_policy(sys.argv[1]) if sys.argv[1] != "untouched" else None

def heap_range():
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = line.split()[0].split("-")
            return int(lo, 16), int(hi, 16)
    return 0, 0

def alloc_and_touch(mib):
    t = torch.empty(mib << 18, dtype=torch.float32)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    lo, hi = heap_range()
    return t, faults, lo <= t.data_ptr() < hi

rounds = []
for _ in range(ROUNDS):
    t, faults, in_heap = alloc_and_touch(int(sys.argv[2]))
    rounds.append(dict(faults=faults, in_heap=in_heap))
    del t
print(json.dumps(dict(took=took, rounds=rounds)))
"""


def _probe(policy: str, mib: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, policy, str(mib)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_reuse_keeps_buffers_up_to_32_mib_without_faults():
    res = _probe("reuse", 16)
    rounds = res["rounds"]
    assert res["took"] is True and all(r["in_heap"] for r in rounds)
    # the first allocation faults its 4,096 pages in (fewer with huge pages). torch asks for
    # 64-byte aligned buffers, which a freed chunk of exactly that size cannot serve, so the
    # heap grows for a few rounds until freed neighbours have merged; from then on every
    # buffer reuses resident pages
    assert rounds[0]["faults"] > 0
    assert [r["faults"] < 64 for r in rounds[-6:]] == [True] * 6, rounds


@pytest.mark.parametrize(
    "policy,mib",
    [("reuse", 64), ("release", 16), ("release", 64), ("untouched", 64)],
)
def test_larger_buffers_are_mappings_of_their_own(policy, mib):
    res = _probe(policy, mib)
    assert res["took"] in (True, None)
    # a mapping of its own, unmapped when freed: every round faults its pages in again
    assert not any(r["in_heap"] for r in res["rounds"])
    assert all(r["faults"] > 0 for r in res["rounds"]), res["rounds"]


def test_training_policy_reads_the_environment(monkeypatch):
    monkeypatch.delenv(malloc.POLICY_ENV, raising=False)
    assert malloc.training_policy() == "reuse"
    monkeypatch.setenv(malloc.POLICY_ENV, " Release ")
    assert malloc.training_policy() == "release"
    monkeypatch.setenv(malloc.POLICY_ENV, "jemalloc")
    with pytest.raises(ValueError, match="AREAL_MEGA_MALLOC='jemalloc'.*reuse, release"):
        malloc.training_policy()
    with pytest.raises(ValueError, match="malloc policy 'fast'"):
        malloc.set_policy("fast")
