"""Teacher scoring for on-policy distillation: a server's logprobs of given token sequences.

The request is SGLang's own way to score tokens (any SGLang server, or the CPU server, answers
it): ``/generate`` with the whole sequence as ``input_ids``, ``sampling_params``
``{"max_new_tokens": 0}``, ``return_logprob: true`` and ``logprob_start_len: start - 1``. The
answer's ``meta_info.input_token_logprobs`` holds ``[logprob, token_id, text]`` for the input
positions ``start - 1 .. len - 1``; the first entry's logprob is always ``None`` (see
:mod:`areal_mega.inference.input_logprobs`), so the values of positions ``start ..`` follow
it. They are at temperature 1 (raw ``log_softmax``), whatever the request's temperature.

A sequence with images (a vision-language teacher) is sent as the rollout sent its prompt:
``input_ids`` are the processor-expanded ids (one ``<|image_pad|>`` per merged patch) and the
batch's ``image_data`` is SGLang's batched form, one entry per sequence: the list of that
sequence's image strings (``data:image/...;base64,`` URLs or raw base64), or None for a text
sequence; the key is left out when no sequence of the batch has images. The answer must count
the ids sent (``meta_info.prompt_tokens``, where given, is ``len(input_ids)``): a server that
expanded the placeholders differently is named.

:func:`score_sequences` spreads batched requests over the client's dispatchable servers; a
server that cannot be reached (or answers 5xx) is marked down and the batch goes to another.
A server marked down is probed again (``/health``) at the next call, and when every server
failed a batch it is retried ``RETRIES`` more rounds after a pause and a probe, so a blip of
the only teacher server does not end the step. Whether the logprobs are usable (finite,
<= 0) is the trainer's check (:mod:`areal_mega.train.screen`).
:class:`TeacherServerScorer` is the synchronous face for the trainer: it owns a
:class:`~areal_mega.rollout.client.RolloutClient` and an event loop on a thread of its own.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Optional

import aiohttp
import numpy as np

from areal_mega.rollout.client import RolloutClient, RolloutRequestError

# sequences per /generate call: a teacher forward per call, batched per sequence length
DEFAULT_BATCH = 8
# when every server failed a chunk: rounds more over all of them, after probing them again
RETRIES = 2
RETRY_BACKOFF_S = 2.0
PROBE_TIMEOUT_S = 10.0


class ScoringError(RuntimeError):
    """A scoring request failed or its answer did not fit the sequence it was for."""


def scoring_body(seqs: list, starts: list, image_data: Optional[list] = None) -> dict:
    """The SGLang ``/generate`` body asking for ``log p(seq[t] | seq[:t])`` from ``t = start``
    on, for each sequence (one batched request). ``image_data``: per sequence its images'
    strings (None or empty: a text sequence), sent as SGLang's batched ``image_data``."""
    body = {
        "input_ids": [list(s) for s in seqs],
        "sampling_params": {"max_new_tokens": 0, "temperature": 1.0},
        "return_logprob": True,
        "logprob_start_len": [int(k) - 1 for k in starts],
    }
    if image_data is not None and any(image_data):
        body["image_data"] = [list(x) if x else None for x in image_data]
    return body


def check_inputs(seqs: list, starts: list, image_data: Optional[list] = None) -> None:
    """``ValueError`` naming the sequence index unless every ``1 <= start <= len(seq)`` and
    ``image_data`` (when given) has one entry (None or a list of strings) per sequence."""
    if len(seqs) != len(starts):
        raise ValueError(f"score_sequences: {len(seqs)} sequences but {len(starts)} starts")
    if image_data is not None:
        if len(image_data) != len(seqs):
            raise ValueError(
                f"score_sequences: {len(seqs)} sequences but {len(image_data)} image_data entries"
            )
        for i, x in enumerate(image_data):
            if x is not None and not (
                isinstance(x, (list, tuple)) and all(isinstance(v, str) and v for v in x)
            ):
                raise ValueError(
                    f"score_sequences: sequence {i}: image_data must be None or a list of "
                    "non-empty strings"
                )
    for i, (s, k) in enumerate(zip(seqs, starts)):
        if not 1 <= int(k) <= len(s):
            raise ValueError(
                f"score_sequences: sequence {i}: start {k} must be in [1, {len(s)}] (its length)"
            )


def values_of(answer: dict, seq: list, start: int, addr: str, index: int) -> list:
    """The logprobs of positions ``start ..`` out of one answer; :class:`ScoringError`
    naming ``addr`` and the sequence ``index`` if the answer does not fit ``seq``."""
    where = f"teacher server {addr}, sequence {index}"
    try:
        entries = answer["meta_info"]["input_token_logprobs"]
    except (KeyError, TypeError):
        raise ScoringError(f"{where}: answer has no meta_info.input_token_logprobs") from None
    counted = answer["meta_info"].get("prompt_tokens")
    if counted is not None and counted != len(seq):
        raise ScoringError(
            f"{where}: the server counts {counted} prompt tokens, {len(seq)} ids were sent (a "
            "sequence with images must be scored by a server of the same image processor)"
        )
    want = len(seq) - start + 1
    if not isinstance(entries, list) or len(entries) != want:
        got = len(entries) if isinstance(entries, list) else type(entries).__name__
        raise ScoringError(f"{where}: expected {want} input_token_logprobs, got {got}")
    ids = [e[1] for e in entries]
    if ids != list(seq[start - 1 :]):
        raise ScoringError(f"{where}: echoed token ids differ from the sequence")
    vals = [e[0] for e in entries[1:]]
    if any(not isinstance(v, (int, float)) or isinstance(v, bool) for v in vals):
        raise ScoringError(f"{where}: a logprob is missing or not a number")
    return [float(v) for v in vals]


async def _score_chunk(
    client: RolloutClient,
    servers: list,
    first: int,
    seqs: list,
    starts: list,
    offset: int,
    timeout: Optional[float],
    image_data: Optional[list] = None,
) -> list:
    """Score one chunk, trying ``servers`` from index ``first`` on; a connection error,
    timeout or 5xx marks that server down and moves on, a 4xx raises at once."""
    span = f"sequences {offset}..{offset + len(seqs) - 1}"
    last: Optional[BaseException] = None
    for attempt in range(RETRIES + 1):
        if attempt:  # every server failed: wait, probe them again, retry (a blip)
            await asyncio.sleep(RETRY_BACKOFF_S * attempt)
            await client.check_health(min(timeout or PROBE_TIMEOUT_S, PROBE_TIMEOUT_S))
            servers = client.live_servers() or servers
        for j in range(len(servers)):
            addr = servers[(first + j) % len(servers)]
            try:
                out = await client.request(
                    addr, "POST", "/generate", scoring_body(seqs, starts, image_data), timeout
                )
            except RolloutRequestError as e:
                raise ScoringError(f"teacher server {addr} refused {span}: {e}") from e
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                client.mark_down(addr, e)
                last = e
                continue
            if not isinstance(out, list) or len(out) != len(seqs):
                raise ScoringError(
                    f"teacher server {addr}, {span}: expected a list of {len(seqs)} answers"
                )
            return [
                values_of(a, s, k, addr, offset + i)
                for i, (a, s, k) in enumerate(zip(out, seqs, starts))
            ]
    raise ScoringError(
        f"no teacher server could score {span} ({RETRIES + 1} rounds over "
        f"every server): last error: {type(last).__name__}: {last}"
    )


async def score_sequences(
    client: RolloutClient,
    seqs: list,
    starts: list,
    batch: int = DEFAULT_BATCH,
    timeout: Optional[float] = None,
    image_data: Optional[list] = None,
) -> list:
    """For each sequence, ``[log p(seq[t] | seq[:t]) for t in range(start, len(seq))]`` as
    scored by the client's servers (at temperature 1). Batches of ``batch`` sequences go
    round-robin to the dispatchable servers, concurrently. ``image_data``: one entry per
    sequence, the images of a sequence whose ids are a processor-expanded prompt (None: a
    text sequence). Raises ``ValueError`` for a start outside ``[1, len(seq)]`` (or
    ``image_data`` that is not one entry per sequence) and :class:`ScoringError` (naming the
    server and the sequence) for a refused request or an answer that does not fit."""
    check_inputs(seqs, starts, image_data)
    if not seqs:
        return []
    if len(client.live_servers()) < len(client.addrs):  # one marked down earlier: probe it
        await client.check_health(min(timeout or PROBE_TIMEOUT_S, PROBE_TIMEOUT_S))
    servers = client.dispatchable() or client.live_servers() or list(client.addrs)
    if not servers:
        raise ScoringError("score_sequences: no teacher server")
    jobs = []
    for c, lo in enumerate(range(0, len(seqs), max(1, batch))):
        hi = min(lo + max(1, batch), len(seqs))
        jobs.append(
            _score_chunk(
                client,
                servers,
                c % len(servers),
                seqs[lo:hi],
                [int(k) for k in starts[lo:hi]],
                lo,
                timeout,
                None if image_data is None else image_data[lo:hi],
            )
        )
    parts = await asyncio.gather(*jobs)
    return [v for part in parts for v in part]


class TeacherServerScorer:
    """Synchronous teacher scoring for the trainer: ``score(seqs, starts)`` returns one
    float32 array per sequence (the logprobs of positions ``start ..``). Owns a
    :class:`RolloutClient` on ``addrs`` and an event loop running on its own thread;
    :meth:`close` stops both."""

    def __init__(
        self,
        addrs: list,
        api_key: Optional[str] = None,
        timeout_s: float = 600.0,
        batch: int = DEFAULT_BATCH,
    ):
        self.client = RolloutClient(list(addrs), api_key=api_key, timeout_s=timeout_s)
        self.timeout_s = timeout_s
        self.batch = batch
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="teacher-scorer", daemon=True
        )
        self._thread.start()
        self._closed = False

    def score(self, seqs: list, starts: list, image_data: Optional[list] = None) -> list:
        """``[np.float32 array of log p(seq[t] | seq[:t]) for t >= start]`` per sequence
        (``image_data``: per sequence its images, None for text); raises what
        :func:`score_sequences` raises."""
        if self._closed:
            raise RuntimeError("TeacherServerScorer is closed")
        fut = asyncio.run_coroutine_threadsafe(
            score_sequences(
                self.client, seqs, starts, self.batch, self.timeout_s, image_data=image_data
            ),
            self._loop,
        )
        return [np.asarray(v, dtype=np.float32) for v in fut.result()]

    def model_info(self) -> dict:
        """``GET /get_model_info`` of every server, by address (SGLang's answer holds
        ``model_path`` and ``tokenizer_path``)."""

        async def ask() -> dict:
            return {
                a: await self.client.request(a, "GET", "/get_model_info", timeout=self.timeout_s)
                for a in self.client.addrs
            }

        return asyncio.run_coroutine_threadsafe(ask(), self._loop).result()

    def close(self) -> None:
        """Close the client's session, stop the loop and join its thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self.client.close(), self._loop).result(30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()

    def __enter__(self) -> "TeacherServerScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
