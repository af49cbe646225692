"""code_reward and its sandbox on real processes: correct/wrong solutions, call-based tests,
an infinite loop, a memory bomb, a fork bomb, a 10 GB write, a write outside the working
directory, a network connection, and 64 concurrent evaluations with bounded processes."""

import json
import logging
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from areal_mega.common import counters
from areal_mega.rewards import (
    code_reward,
    extract_code,
    extract_gsm8k_answer,
    gsm8k_reward,
    parse_code_tests,
)
from areal_mega.rewards import sandbox as sandbox_mod
from areal_mega.rewards.sandbox import CodeSandbox

ADD = {"inputs": ["1 2\n", "10 20\n", "5 -5\n"], "outputs": ["3\n", "30\n", "0\n"]}


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\n"


def run(box, code, tests=ADD, **kw):
    return box.run(code, parse_code_tests(tests), **kw)


@pytest.fixture(scope="module")
def box():
    return CodeSandbox(max_parallel=4)


def test_extract_code_takes_the_last_python_block():
    text = "```python\nprint(1)\n```\nthen\n```\nplain\n```\n```py\nprint(2)\n```"
    assert extract_code(text) == "print(2)\n"
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"
    assert extract_code("no code") is None


def test_parse_code_tests_errors_name_the_problem():
    assert parse_code_tests(json.dumps(ADD))["fn_name"] is None
    with pytest.raises(ValueError, match="not valid JSON"):
        parse_code_tests("{oops")
    with pytest.raises(ValueError, match="'outputs' must be a list"):
        parse_code_tests({"inputs": ["1"]})
    with pytest.raises(ValueError, match="1 inputs but 2 outputs"):
        parse_code_tests({"inputs": ["1"], "outputs": ["1", "2"]})


def test_correct_scores_one_wrong_scores_zero_partial_is_a_fraction():
    good = fenced("a, b = map(int, input().split())\nprint(a + b)")
    wrong = fenced("a, b = map(int, input().split())\nprint(a * b)")
    partial = fenced("a, b = map(int, input().split())\nprint(a + b if a < 5 else -1)")
    answer = json.dumps(ADD)
    assert code_reward("", good, answer) == 1.0
    assert code_reward("", wrong, answer) == 0.0
    assert code_reward("", partial, ADD) == pytest.approx(1 / 3)
    assert code_reward("", partial, ADD, all_or_nothing=True) == 0.0
    assert code_reward("", "no code here", ADD) == 0.0
    assert code_reward("", good, "not json") == 0.0


def test_call_based_function_and_solution_class():
    tests = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]}
    assert code_reward("", fenced("def add(a, b):\n    return a + b"), tests) == 1.0
    cls = "class Solution:\n    def add(self, a, b):\n        return a + b"
    assert code_reward("", fenced(cls), tests) == 1.0
    assert code_reward("", fenced("def add(a, b):\n    return a - b"), tests) == 0.0


def test_infinite_loop_is_killed_within_the_limit(box):
    t0 = time.monotonic()
    before = counters.snapshot().get("sandbox/test_kills", 0)
    res = run(box, "while True:\n    pass", {"inputs": ["1"], "outputs": ["1"]}, timeout_s=1.0)
    assert counters.snapshot()["sandbox/test_kills"] == before + 1  # counted for the metrics
    elapsed = time.monotonic() - t0
    assert res.passed == 0 and not res.timed_out  # the per-test deadline killed it
    # the loop itself was killed within the time limit plus a second (interpreter start-up
    # before the test is not part of it; the runner's deadline polls every 20 ms)
    assert len(res.test_seconds) == 1 and res.test_seconds[0] < 1.0 + 1.0, res.test_seconds
    print(
        f"infinite loop: killed after {res.test_seconds[0]:.2f}s (limit 1.0s), scored 0 "
        f"after {elapsed:.2f}s wall"
    )


def test_memory_bomb_fork_bomb_and_huge_file_are_contained(box, tmp_path):
    one = {"inputs": ["x"], "outputs": ["done"]}
    mem = run(box, "x = bytearray(8 << 30)\nprint('done')", one, memory_mb=512)
    assert mem.passed == 0
    before = len(psutil.pids())
    fork = run(
        box,
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        one,
        timeout_s=1.0,
        max_procs=16,
    )
    assert fork.passed == 0
    time.sleep(0.2)
    assert len(psutil.pids()) < before + 8  # nothing of the fork bomb outlives it
    big = run(
        box,
        "f = open('big.bin', 'wb')\nblock = b'0' * (1 << 20)\n"
        "for _ in range(10 * 1024):\n    f.write(block)\nprint('done')",
        one,
        max_file_mb=8,
    )
    assert big.passed == 0
    print(f"isolation on this kernel: {big.isolation}")


def test_write_outside_the_working_directory_fails(box, tmp_path):
    target = tmp_path / f"escape-{uuid.uuid4().hex}"
    code = (
        f"try:\n    open({str(target)!r}, 'w').write('x')\n    print('written')\n"
        "except OSError as e:\n    print('denied')\nopen('inside.txt', 'w').write('ok')"
    )
    res = run(box, code, {"inputs": [""], "outputs": ["denied"]})
    if res.isolation.get("readonly") or res.isolation.get("root"):
        # read-only mounts, or (without them) the slot's own uid in root's private tmp_path
        assert res.passed == 1
        assert not target.exists()
    else:  # neither: this kernel gives no way to stop it, and the test says so
        pytest.skip(f"no read-only mount namespace here: {res.isolation.get('why')}")


@pytest.mark.parametrize("namespaces", [True, False])
def test_network_connection_fails_or_the_missing_namespace_is_logged(namespaces, caplog):
    box = CodeSandbox(max_parallel=1, namespaces=namespaces)
    listener = socket.create_server(("127.0.0.1", 0))  # reachable from this namespace
    port = listener.getsockname()[1]
    code = (
        "import socket\ntry:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    print('connected')\nexcept OSError:\n    print('blocked')"
    )
    try:
        with caplog.at_level(logging.WARNING, logger=sandbox_mod.__name__):
            res = run(box, code, {"inputs": [""], "outputs": ["blocked"]})
    finally:
        listener.close()
    if res.isolation.get("netns"):
        assert res.passed == 1
    else:  # without a network namespace the connection works, and the log says so once
        assert res.passed == 0 and "network access is NOT blocked" in caplog.text
        print(f"without namespaces: {caplog.text.strip()}")
    # the limits hold either way: a fork bomb is contained
    fork = run(
        box,
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        {"inputs": ["x"], "outputs": ["done"]},
        timeout_s=0.5,
        max_procs=8,
    )
    assert fork.passed == 0 and not fork.timed_out


def test_64_concurrent_evaluations_with_bounded_processes():
    box = CodeSandbox(max_parallel=3)
    good = "a, b = map(int, input().split())\nprint(a + b)"
    one = {"inputs": ["2 3"], "outputs": ["5"]}
    peak = {"n": 0}
    stop = threading.Event()

    me = psutil.Process()
    # processes this pytest worker already has (an earlier test's server still exiting, a
    # zombie not yet reaped) are not the evaluations'
    before = {p.pid for p in me.children(recursive=True)}

    def watch():
        while not stop.is_set():
            ours = [p for p in me.children(recursive=True) if p.pid not in before]
            peak["n"] = max(peak["n"], len(ours))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda _: run(box, good, one), range(64)))
    elapsed = time.monotonic() - t0
    stop.set()
    watcher.join()
    assert all(r.passed == 1 for r in results)
    assert box.peak_running == 3
    # each evaluation: its runner, the namespace's PID 1 and one test child at a time
    assert peak["n"] <= 3 * 3, peak
    print(f"64 evaluations in {elapsed:.2f}s, peak {peak['n']} sandbox processes")


def test_gsm8k_extractor_and_reward():
    assert extract_gsm8k_answer("so 6*7 = 42.\n#### 42") == "42"
    assert extract_gsm8k_answer("#### 1,234") == "1234"
    assert extract_gsm8k_answer("the answer is -3.5.") == "-3.5"
    assert extract_gsm8k_answer("none") is None
    assert gsm8k_reward("", "I think #### 42", "She has 6*7=42 apples.\n#### 42") == 1.0
    assert gsm8k_reward("", "#### 41", "#### 42") == 0.0
    assert gsm8k_reward("", "no number", "#### 42") == 0.0


def test_working_directory_is_private_and_removed(box, tmp_path):
    box2 = CodeSandbox(max_parallel=1, tmp_root=str(tmp_path))
    res = run(
        box2, "import os\nprint(len(os.listdir('.')) > 0)", {"inputs": [""], "outputs": ["True"]}
    )
    assert res.passed == 1
    assert list(Path(tmp_path).iterdir()) == []
