"""Tool-integrated math (program-aided): the policy writes a Python expression through the
OpenAI-compatible client, a sandboxed Python tool runs it, and the tool's output is the answer.

    rollout.workflow: examples/tool_math/tool_math.py:tool_math_episode

The model is offered a ``python`` tool. A model that knows the Qwen/Hermes format calls it
(``<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>``: the code runs as
is); a tiny model from scratch cannot write that JSON, so its reply up to the first ``=`` is
taken as the expression and run as ``print(<expr>)``. Reward: 0.2 when the program ran, plus 0.8
times
the fraction of characters of its output that match the answer.

The sandbox is a fresh ``python -I -S`` subprocess in an empty temporary directory, with an
empty environment, limits on address space (``memory_mb``) and CPU seconds, a wall-clock
timeout, its own process group (killed on timeout) and its output capped. It is a resource
sandbox, not a security boundary: run untrusted models' code inside a container.
"""

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run Python code and return what it prints.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string"}},
            "required": ["code"],
        },
    },
}


def run_python(
    code: str, timeout_s: float = 3.0, memory_mb: int = 256, max_output: int = 1000
) -> tuple:
    """Run ``code`` in the sandbox; returns ``(ok, output)`` (stdout, or the error's last
    line)."""

    def limits():
        mem = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        cpu = max(1, int(timeout_s))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))

    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", code],
            cwd=tmp,
            env={},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=limits,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return False, "TimeoutError: the program ran too long"
    if proc.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # the CPU-time limit hit first
        return False, "TimeoutError: the program used too much CPU time"
    if proc.returncode != 0:
        lines = err.decode(errors="replace").strip().splitlines()
        return False, (lines[-1] if lines else f"exit code {proc.returncode}")[:max_output]
    return True, out.decode(errors="replace").strip()[:max_output]


def char_match(text: str, want: str) -> float:
    """Fraction of positions where ``text`` matches ``want``, over the longer of the two."""
    if not text and not want:
        return 1.0
    return sum(a == b for a, b in zip(text, want)) / max(len(text), len(want), 1)


async def tool_math_episode(ctx, item, max_code_tokens=8, timeout_s=3.0, memory_mb=256):
    """One sample: the model writes the program, the tool runs it, the output is scored."""
    messages = [{"role": "user", "content": item["prompt"]}]
    reply = await ctx.client.chat.completions.create(
        model="policy", messages=messages, tools=[PYTHON_TOOL], max_tokens=max_code_tokens
    )
    msg = reply.choices[0].message
    if msg.tool_calls:
        code = json.loads(msg.tool_calls[0].function.arguments).get("code", "")
    else:
        code = f"print({(msg.content or '').split('=')[0].strip()})"
    ok, output = await ctx.run_blocking(run_python, code, timeout_s, memory_mb)
    return (0.2 if ok else 0.0) + 0.8 * (char_match(output, str(item["answer"])) if ok else 0.0)
