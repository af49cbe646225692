"""examples/tool_math: the sandboxed Python tool (time and memory limits, errors as text) and
the episode's loading as a configured workflow."""

from pathlib import Path

from areal_mega.common.loading import load_object
from areal_mega.config import load_config
from areal_mega.workflow.api import FunctionWorkflow
from areal_mega.workflow.builtin import workflow_from_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tool_math" / "tool_math.py"


def test_python_tool_sandbox_limits():
    run_python = load_object(f"{EXAMPLE}:run_python", "rollout.workflow")
    assert run_python("print(12*34)") == (True, "408")
    # nothing inherited from the worker's environment (Python itself may set LC_CTYPE)
    assert run_python("import os; print(sorted(set(os.environ) - {'LC_CTYPE'}))") == (True, "[]")
    ok, out = run_python("x = bytearray(2 * 10**9)", memory_mb=256)
    assert not ok and "MemoryError" in out
    ok, out = run_python("while True: pass", timeout_s=1.0)
    assert not ok and "TimeoutError" in out
    ok, out = run_python("print(1+")
    assert not ok and "SyntaxError" in out
    ok, out = run_python("print('x' * 5000)", max_output=10)
    assert ok and out == "x" * 10
    char_match = load_object(f"{EXAMPLE}:char_match", "rollout.workflow")
    assert char_match("102", "102") == 1.0 and char_match("12", "102") == 1 / 3


def test_tool_math_config_builds_the_workflow():
    cfg = load_config(
        ROOT / "examples" / "tool_math" / "config.yaml",
        [f"rollout.workflow={EXAMPLE}:tool_math_episode"],
    )
    wf = workflow_from_config(cfg.rollout)
    assert isinstance(wf, FunctionWorkflow)
    assert wf.kwargs == {"max_code_tokens": 8, "timeout_s": 3.0, "memory_mb": 256}
