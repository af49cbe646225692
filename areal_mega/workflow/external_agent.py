"""External agents, unmodified: any program that speaks the OpenAI API is an episode.

    rollout.workflow: areal_mega.workflow.external_agent:ExternalAgent
    rollout.workflow_kwargs: {command: "{python} my_agent.py", timeout_s: 120, max_concurrent: 8}

(``{python}`` in the command is replaced by the rollout worker's own interpreter.)

For each sample, :class:`ExternalAgent` runs ``command`` in a shell, in its own process group,
with ``OPENAI_BASE_URL`` (the rollout worker's endpoint, ``http://127.0.0.1:PORT/v1``) and
``OPENAI_API_KEY`` (a key for this sample alone: every call made with it is recorded on this
episode) in its environment and the prompt item as one JSON object on stdin. The last non-empty
line of its stdout must be a JSON object ``{"reward": <number>}``. The trajectories are built
from the calls it made (:mod:`areal_mega.workflow.episode_export`).

A program that exits non-zero, runs past ``timeout_s`` (its whole process group is killed),
prints no reward or a malformed one, or makes no call is a failed sample: counted by reason
(:meth:`ExternalAgent.stats`), logged with the tail of its stderr, and left out of the group;
never a crash. A group whose every sample failed is a failed episode for the controller
(retried, then by default dropped and counted, up to a failure-rate ceiling:
``rollout.on_episode_failure``, :mod:`areal_mega.rollout.failures`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import shlex
import signal
import sys
from collections import Counter
from typing import Optional

from areal_mega.workflow.api import EpisodeWorkflow, SampleContext

log = logging.getLogger(__name__)


def parse_reward(stdout: str) -> float:
    """The reward from the last non-empty line of ``stdout`` (``{"reward": <number>}``).
    Raises ``ValueError`` saying what is wrong."""
    lines = [ln.strip() for ln in stdout.splitlines() if ln.strip()]
    if not lines:
        raise ValueError('printed nothing (the last line must be {"reward": <number>})')
    try:
        obj = json.loads(lines[-1])
    except ValueError:
        raise ValueError(f"last line is not JSON: {lines[-1][:200]!r}") from None
    r = obj.get("reward") if isinstance(obj, dict) else None
    if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r):
        raise ValueError(f"last line has no finite number 'reward': {lines[-1][:200]!r}")
    return float(r)


class ExternalAgent(EpisodeWorkflow):
    """Runs ``command`` once per sample (see the module doc). ``timeout_s``: wall-clock limit
    per sample; ``max_concurrent``: agent processes at once; ``env``: extra environment
    variables; ``cwd``: working directory of the command."""

    def __init__(
        self,
        command: str,
        timeout_s: float = 600.0,
        max_concurrent: int = 8,
        env: Optional[dict] = None,
        cwd: Optional[str] = None,
    ):
        if not isinstance(command, str) or not command.strip():
            raise ValueError("rollout.workflow_kwargs.command: a shell command is required")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"rollout.workflow_kwargs.timeout_s={timeout_s!r}: must be > 0")
        if not (isinstance(max_concurrent, int) and max_concurrent >= 1):
            raise ValueError(
                f"rollout.workflow_kwargs.max_concurrent={max_concurrent!r}: "
                "must be an integer >= 1"
            )
        # "{python}": the interpreter of the rollout worker (whose venv has `openai`)
        self.command = command.replace("{python}", shlex.quote(sys.executable))
        self.timeout_s = float(timeout_s)
        self.max_concurrent = max_concurrent
        self.env = {str(k): str(v) for k, v in (env or {}).items()}
        self.cwd = cwd
        self.failures: Counter = Counter()
        self.n_ok = 0
        self._sem: Optional[asyncio.Semaphore] = None

    def stats(self) -> dict:
        """Counters: finished agent runs and failures by reason."""
        return {
            "agent_ok": self.n_ok,
            **{f"agent_failed/{k}": v for k, v in sorted(self.failures.items())},
        }

    def _fail(self, ctx: SampleContext, kind: str, detail: str, stderr: bytes = b"") -> float:
        self.failures[kind] += 1
        ctx.failed = f"{kind}: {detail}"
        tail = stderr.decode(errors="replace").strip()[-500:]
        log.warning(
            "agent sample %s failed (%s, %d %s so far): %s%s",
            ctx.sample_id,
            kind,
            self.failures[kind],
            kind,
            detail,
            f"; stderr: {tail}" if tail else "",
        )
        return 0.0

    async def episode(self, ctx: SampleContext, item: dict) -> float:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_concurrent)
        async with self._sem:
            url, key = await ctx.openai_endpoint()
            try:
                return await self._run(ctx, item, url, key)
            finally:
                ctx.close_endpoint(key)

    async def _run(self, ctx: SampleContext, item: dict, url: str, key: str) -> float:
        env = dict(os.environ, **self.env, OPENAI_BASE_URL=url, OPENAI_API_KEY=key)
        proc = await asyncio.create_subprocess_shell(
            self.command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            cwd=self.cwd,
            start_new_session=True,
        )
        payload = (json.dumps(item, default=str) + "\n").encode()
        try:
            out, err = await asyncio.wait_for(proc.communicate(payload), self.timeout_s)
        except asyncio.TimeoutError:
            await _kill_group(proc)
            return self._fail(
                ctx, "timeout", f"no exit within {self.timeout_s:g} s (process group killed)"
            )
        except BaseException:  # cancelled (the rollout stops): leave nothing behind
            await _kill_group(proc)
            raise
        if proc.returncode != 0:
            return self._fail(ctx, "exit_code", f"exited with {proc.returncode}", err)
        try:
            reward = parse_reward(out.decode(errors="replace"))
        except ValueError as e:
            return self._fail(ctx, "no_reward", str(e), err)
        if not ctx.client.records:
            return self._fail(ctx, "no_calls", "made no call to OPENAI_BASE_URL", err)
        self.n_ok += 1
        return reward


async def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        await asyncio.wait_for(proc.wait(), 10)
    except asyncio.TimeoutError:
        log.error("agent process %d did not die after SIGKILL", proc.pid)
