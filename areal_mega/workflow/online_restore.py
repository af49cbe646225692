"""Online sessions as samples, and the ended sessions a restarted rollout worker still waits on.

A session the agent ended before its reward came is written to the gateway's journal with
everything needed to train it (:func:`ended_record`: its completions token for token, its
sample and group ids, and the SHA-256 of its session key, never the key). When the rollout
worker is killed and relaunched, each such session comes back as a :class:`RestoredSession`:
its reward may still be posted (with the admin key or the session's own key), within
``reward_timeout_s`` counted from the restart; it then becomes a done session of its prompt,
delivered with its original ids when the controller generates that prompt again.

A completion with images is journaled with its images as sent (``image_data``: the agent's
data URLs, JSON strings), never the decoded pictures; a restored session decodes them again
and the gateway's image processor (the policy's) encodes them for the trainer, as for a live
session.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from areal_mega.data.images import load_image
from areal_mega.workflow.episode_export import export_completions
from areal_mega.workflow.online_sessions import check_reward, fully_rewarded, matching_completions
from areal_mega.workflow.openai_client import MAX_IMAGE_PIXELS, CompletionRecord
from areal_mega.workflow.tokens import TokenSeq


def key_digest(key: str) -> str:
    """The SHA-256 (hex) of a session key, as journaled."""
    return hashlib.sha256(key.encode()).hexdigest()


def session_trajectories(
    sample, records: list, reward, completion_rewards: dict, turn_discount: float, meta: dict
) -> list:
    """The trajectories of one done session. ``sample`` makes a trajectory from a
    :class:`TokenSeq` (``sample.trajectory(...)``, as
    :class:`~areal_mega.workflow.api.SampleContext` does); with per-completion rewards each
    completion is its own sample (``-c<k>`` appended to the id), else the session is one
    sample or one per completion (:func:`~areal_mega.workflow.episode_export.
    export_completions`). ``meta`` is added to every trajectory's meta."""
    if not completion_rewards:
        out = export_completions(sample, reward, records, turn_discount)
    else:
        out = []
        for k, rec in enumerate(records):
            seq = TokenSeq()
            seq.add_context(rec.prompt_ids)
            seq.add_generated(rec.output_ids, rec.logprobs, rec.versions, rec.routed_experts)
            r = completion_rewards.get(rec.completion_id, reward)
            out.append(
                sample.trajectory(
                    seq,
                    float(r),
                    len(rec.prompt_ids),
                    rec.finish_reason,
                    suffix=f"-c{k}",
                    server_id=rec.server,
                    meta={"n_calls": 1, "chained": False},
                )
            )
    for t in out:
        t.meta.update(meta)
    return out


def ended_record(session, sample, key: str) -> dict:
    """The journal record of an ended ``session`` (its recording ``sample`` context and
    session ``key``): JSON-able, exact (Python floats round-trip through JSON)."""
    return {
        "session_id": session.session_id,
        "task_id": session.task_id,
        "prompt_index": sample.item.get("prompt_index"),
        "sample_id": sample.sample_id,
        "group_id": sample.group_id,
        "key_sha256": key_digest(key),
        "reward": session.reward,
        "completion_rewards": dict(session.completion_rewards),
        "records": [_record_json(r) for r in sample.client.records],
    }


def _record_json(rec: CompletionRecord) -> dict:
    d = asdict(rec)
    d.pop("images")  # decoded pictures: restored from image_data (the URLs as sent)
    routes = d.pop("routed_experts")
    if routes is not None:  # routing replay: an integer array, kept with its dtype
        routes = np.asarray(routes)
        d["routed_experts"] = {
            "dtype": routes.dtype.str,
            "shape": list(routes.shape),
            "ids": routes.ravel().tolist(),
        }
    return d


def _record_of(d: dict) -> CompletionRecord:
    d = dict(d)
    routes = d.pop("routed_experts", None)
    if routes is not None:
        d["routed_experts"] = np.asarray(routes["ids"], dtype=np.dtype(routes["dtype"])).reshape(
            routes["shape"]
        )
    d["images"] = [
        load_image(u, base_dir=Path("/"), what=f"image {k}", max_source_pixels=MAX_IMAGE_PIXELS)
        for k, u in enumerate(d.get("image_data") or [])
    ]
    return CompletionRecord(**d)


class RestoredSession:
    """An ended session from before a restart, waiting for its reward until ``deadline``
    (``time.monotonic()`` seconds)."""

    def __init__(self, record: dict, deadline: float):
        self.session_id = record["session_id"]
        self.task_id = record["task_id"]
        self.prompt_index = record["prompt_index"]
        self.sample_id = record["sample_id"]
        self.group_id = record["group_id"]
        self.key_sha256 = record["key_sha256"]
        self.reward = record.get("reward")
        self.completion_rewards = dict(record.get("completion_rewards") or {})
        self.records = [_record_of(r) for r in record["records"]]
        self.deadline = deadline
        self.state = "ended"
        self.image_processor = None  # the policy's, for completions with images

    def trajectory(
        self,
        seq: TokenSeq,
        reward: float,
        prompt_len: int,
        finish_reason: str,
        suffix: str = "",
        server_id: str = "",
        meta=None,
        multimodal=None,
    ):
        """Like :meth:`SampleContext.trajectory <areal_mega.workflow.api.SampleContext.
        trajectory>`, with the session's original ids."""
        return seq.to_trajectory(
            reward=reward,
            sample_id=self.sample_id + suffix,
            group_id=self.group_id,
            prompt_len=prompt_len,
            finish_reason=finish_reason,
            server_id=server_id,
            meta=meta,
            multimodal=multimodal,
        )

    def set_reward(self, value, completion_id, max_abs: float) -> None:
        """Record a reward for the session or for one completion (its id, or the id of the
        response that holds it); :class:`SessionError` for a bad value or an unknown id."""
        v = check_reward(value, max_abs)
        if completion_id is None:
            self.reward = v
            return
        for c in matching_completions(
            [r.completion_id for r in self.records], completion_id, self.session_id
        ):
            self.completion_rewards[c] = v

    def has_reward(self) -> bool:
        """A session reward, or one for each of its completions."""
        return fully_rewarded(
            self.reward, self.completion_rewards, [r.completion_id for r in self.records]
        )

    def trajectories(self, turn_discount: float, image_processor=None) -> list:
        """Its trajectories, once it has its reward; ``image_processor`` (the policy's)
        encodes the images of completions that have them."""
        if image_processor is not None:
            self.image_processor = image_processor
        if any(r.images for r in self.records) and self.image_processor is None:
            raise ValueError(
                f"online session {self.session_id}: its completions hold images and the "
                "gateway has no image processor (a text policy cannot train them)"
            )
        return session_trajectories(
            self,
            self.records,
            self.reward,
            self.completion_rewards,
            turn_discount,
            {
                "task_id": self.task_id,
                "session_id": self.session_id,
                "prompt_index": self.prompt_index,
                "restored": True,
            },
        )


def restored_sessions(records: list, reward_timeout_s: float, now=None) -> dict:
    """``{session id: RestoredSession}`` for the journal's ended sessions still waiting for a
    reward, each given ``reward_timeout_s`` from ``now`` (default: the monotonic clock)."""
    now = time.monotonic() if now is None else now
    return {r["session_id"]: RestoredSession(r, now + reward_timeout_s) for r in records}
