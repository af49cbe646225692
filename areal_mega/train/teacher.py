"""On-policy distillation (``algorithm.opd``) in the RL step and the trainer session.

* :func:`build_teacher` — the in-trainer teacher (``teacher.path``): a forward-only
  :class:`~areal_mega.engine.megatron_engine.MegatronEngine` (``role="ref"``) on the trainer's
  mesh and layout, with its own HF config and dtype (``teacher.dtype``, default
  ``model.dtype``). The session loads its weights from ``<run_dir>/init_mcore_teacher``
  (converted once from ``teacher.path``; never from ``checkpoint.load``, which holds the
  student), on a fresh run and on a resume alike.
* :func:`build_teacher_scorer` — a teacher served by SGLang-compatible servers
  (``teacher.server_addrs``): a :class:`~areal_mega.rollout.scoring.TeacherServerScorer`, which
  scores given tokens with SGLang's prompt-logprob request (at temperature 1, so
  ``actor.temperature`` must be 1 with a served teacher; the config check says so). For a
  vision-language student every server must serve a vision-language model
  (``/get_model_info``'s ``has_image_understanding``) of the student's image processor; each
  sequence with images is scored with the images its prompt sent to the rollout servers
  (``image_data`` of the micro-batch, from the trajectory's ``meta["image_data"]``).
* :func:`vision_of` — a vision-language student's
  :class:`~areal_mega.dataplane.multimodal.VisionSpec`, after refusing the engines that could
  not see its images (a text teacher or reference model).
* :func:`teacher_logprobs` — the ONE place teacher logprobs come from: the in-trainer engine's
  forward at ``actor.temperature`` (as the proximal and reference logprobs), or the servers'
  scores of each packed sequence from its first loss token on.
* :func:`opd_step` — attaches ``teacher_logprobs`` to the micro-batches, replaces (``pure``) or
  shifts (``add``) their advantages with :func:`~areal_mega.algo.distill.opd_advantages`
  student = ``prox_logprobs``) and returns the ``opd/*`` and ``time/teacher`` statistics. A
  sequence whose teacher logprobs are NaN/inf or above 0 is dropped from the step's loss
  (:func:`~areal_mega.train.screen.refuse_bad_teacher_rows`; ``refused/teacher``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import torch
import torch.distributed as dist

from areal_mega.algo.distill import opd_advantages, reverse_kl_sums
from areal_mega.config import ConfigError, check_same_tokenizer
from areal_mega.models.vlm.config import DEFAULT_MAX_IMAGES, is_vl_config, vision_spec
from areal_mega.rollout.scoring import TeacherServerScorer
from areal_mega.train import batches
from areal_mega.train.screen import refuse_bad_teacher_rows

__all__ = [
    "build_teacher",
    "build_teacher_scorer",
    "teacher_model_config",
    "teacher_logprobs",
    "opd_step",
    "vision_of",
]

log = logging.getLogger(__name__)


def teacher_model_config(cfg):
    """``cfg.model`` with the teacher's path and dtype (``teacher.dtype`` or ``model.dtype``);
    the other model keys (vocab padding, attention backend) are the trainer's."""
    return dataclasses.replace(
        cfg.model,
        path=cfg.teacher.path,
        dtype=cfg.teacher.dtype or cfg.model.dtype,
        recompute_granularity=None,
    )


def build_teacher(cfg, mesh):
    """The in-trainer teacher engine of ``cfg`` (RL, ``algorithm.opd`` on, ``teacher.path``
    set), or None (no OPD, or a served teacher). Its weights are loaded by the session."""
    if cfg.mode != "rl" or cfg.algorithm.opd == "off" or not cfg.teacher.path:
        return None
    from areal_mega.engine.megatron_engine import MegatronEngine

    return MegatronEngine(
        teacher_model_config(cfg), hf_config=cfg.teacher.path, role="ref", mesh=mesh, seed=cfg.seed
    )


def vision_of(cfg, actor_hf: dict, ref_hf=None, teacher_hf=None):
    """The student's :class:`~areal_mega.dataplane.multimodal.VisionSpec` when its HF config
    ``actor_hf`` is a vision-language model's (its receiver checks arriving images against it),
    else None.

    Every engine that runs a VL student's micro-batches gets their images, so each must be a
    vision-language model too: a text reference model (``ref_hf``, from ``ref.path``) or
    in-trainer teacher (``teacher_hf``, from ``teacher.path``) is refused naming the key
    (ConfigError). A critic (``critic.enabled``) is the student's VL model with a value head
    (:class:`~areal_mega.engine.critic.CriticEngine`), so it sees them.
    A served teacher (``teacher.server_addrs``) is checked when it is reached
    (:func:`build_teacher_scorer`: a vision-language model of the same image processor)."""
    if not is_vl_config(actor_hf):
        return None
    for key, hf in (("ref.path", ref_hf), ("teacher.path", teacher_hf)):
        if hf is not None and not is_vl_config(hf):
            raise ConfigError(
                f"{key}: a text model ({hf.get('model_type')!r}) cannot see the images of the "
                f"vision-language student {cfg.model.path!r}; use a vision-language model of "
                "the same family"
            )
    # the receiver takes every prompt the dataset may hold (data.images.max_images)
    return vision_spec(actor_hf, max_images=max(DEFAULT_MAX_IMAGES, cfg.data.images.max_images))


def build_teacher_scorer(cfg, vision=None):
    """The scorer of a served teacher (RL, ``algorithm.opd`` on, ``teacher.server_addrs``
    set), or None. ``vision``: the student's
    :class:`~areal_mega.dataplane.multimodal.VisionSpec` (a vision-language student): every
    server must then serve a vision-language model of the student's image processor
    (:func:`check_served_vision`). The session closes it."""
    t = cfg.teacher
    if cfg.mode != "rl" or cfg.algorithm.opd == "off" or not t.server_addrs:
        return None
    scorer = TeacherServerScorer(t.server_addrs, api_key=t.api_key, timeout_s=t.request_timeout_s)
    try:
        for addr, info in scorer.model_info().items():
            if vision is not None:
                check_served_vision(addr, info, cfg.model.path)
            check_served_tokenizer(addr, info, cfg.model.path)
    except BaseException:
        scorer.close()
        raise
    return scorer


def check_served_tokenizer(addr: str, info: dict, model_path: str) -> None:
    """The tokenizer a teacher server reports (``/get_model_info``: ``tokenizer_path``, else
    ``model_path``) against the student's, when that path is a directory on this machine
    (:func:`~areal_mega.config.check_same_tokenizer`, a ConfigError naming both); a
    path this machine cannot read is logged and left to the user."""
    path = info.get("tokenizer_path") or info.get("model_path") or ""
    if path and Path(path).is_dir():
        check_same_tokenizer(path, model_path)
    else:
        log.warning(
            "teacher server %s: tokenizer %r is not readable here; make sure it is "
            "the student's (%s)",
            addr,
            path,
            model_path,
        )


IMAGE_PROCESSOR_KEYS = (
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "min_pixels",
    "max_pixels",
    "size",
    "image_mean",
    "image_std",
    "rescale_factor",
    "do_rescale",
    "do_normalize",
    "do_resize",
    "do_convert_rgb",
    "resample",
)
"""``preprocessor_config.json`` keys that decide the pixels and the placeholder count of an
image; a served teacher's must equal the student's."""


def check_served_vision(addr: str, info: dict, model_path: str) -> None:
    """A teacher server for a vision-language student: its ``/get_model_info`` must say it
    understands images (SGLang's ``has_image_understanding``; a text model is refused naming
    the server and its ``model_type``, ConfigError), and where its model directory is readable
    here, its image processor (``preprocessor_config.json``, :data:`IMAGE_PROCESSOR_KEYS`)
    must be the student's, or the expanded prompt ids would not fit its images."""
    if info.get("has_image_understanding") is not True:
        raise ConfigError(
            f"teacher.server_addrs: server {addr} serves {info.get('model_path')!r} "
            f"(model_type {info.get('model_type')!r}), which does not understand images "
            f"(has_image_understanding={info.get('has_image_understanding')!r}); the "
            f"vision-language student {model_path!r} needs a vision-language teacher of the "
            "same image processor"
        )
    path = info.get("model_path") or ""
    mine = Path(model_path) / "preprocessor_config.json"
    theirs = Path(path) / "preprocessor_config.json" if path else None
    if theirs is None or not theirs.is_file() or not mine.is_file():
        log.warning(
            "teacher server %s: image processor of %r is not readable here; make sure it is "
            "the student's (%s)",
            addr,
            path,
            model_path,
        )
        return
    a, b = (json.loads(p.read_text()) for p in (mine, theirs))
    diff = [k for k in IMAGE_PROCESSOR_KEYS if a.get(k) != b.get(k)]
    if diff:
        what = ", ".join(f"{k}={b.get(k)!r} (student: {a.get(k)!r})" for k in diff)
        raise ConfigError(
            f"teacher.server_addrs: server {addr} ({path!r}) has another image processor than "
            f"the student {model_path!r}: {what}"
        )


def served_logprobs(scorer, micro_batches: list) -> list:
    """The served teacher's logprobs for packed ``micro_batches`` in their next-token layout
    (position t of a sequence: log p(ids[t+1] | ids[:t+1])), one fp32 ``[T]`` tensor each:
    every sequence is scored from its first loss token on, all of them in one scorer call (so
    the requests spread over the servers together); earlier positions and padding are 0. A
    sequence with images is sent with them as its prompt sent them to the rollout servers
    (the micro-batch's ``image_data``); one whose images came without them (a workflow that
    built the trajectory without ``SampleContext.trajectory``) cannot be scored: it is logged
    by name and gets NaN, so the step's screen drops it from the loss (``refused/teacher``)."""
    outs = [torch.zeros(mb["input_ids"].shape[0], dtype=torch.float32) for mb in micro_batches]
    seqs, starts, spans, images = [], [], [], []
    for out, mb in zip(outs, micro_batches):
        ids, mask = mb["input_ids"], mb["loss_mask"]
        counts = mb.get("image_counts")
        sent = mb.get("image_data")
        bounds = zip(mb["cu_seqlens_padded"].tolist(), mb["seqlens"].tolist())
        for b, (start, n) in enumerate(bounds):
            first = torch.nonzero(mask[start : start + n - 1]).flatten()
            if first.numel() == 0:
                continue
            t0 = int(first[0])  # layout position t0 describes token t0 + 1
            n_images = 0 if counts is None else int(counts[b])
            items = list(sent[b]) if sent is not None and sent[b] else []
            if len(items) != n_images:
                log.warning(
                    "sample %r: %d image(s) but %d image_data strings to send the served "
                    "teacher (SampleContext.trajectory keeps them in meta['image_data']); "
                    "dropped from this step's loss",
                    mb["sample_ids"][b],
                    n_images,
                    len(items),
                )
                out[start + t0 : start + n - 1] = float("nan")
                continue
            seqs.append(ids[start : start + n].tolist())
            starts.append(t0 + 1)
            spans.append((out, start + t0, start + n - 1))
            images.append(items or None)
    scores = scorer.score(seqs, starts, images if any(images) else None) if seqs else []
    for (out, lo, hi), lp in zip(spans, scores):
        out[lo:hi] = torch.from_numpy(lp)
    return outs


def teacher_logprobs(session, micro_batches: list) -> list:
    """The teacher's log p(token t+1 | tokens ≤ t) for every micro-batch, as fp32 ``[T]`` CPU
    tensors in the micro-batches' next-token layout. In the trainer: computed at
    ``actor.temperature``, 0 where ``labels`` is -1, collective over the trainer ranks (the
    teacher runs the trainer's pipeline schedule). Served: every rank scores its own
    micro-batches over HTTP in one call (:func:`served_logprobs`)."""
    if session.teacher is not None:
        return session.teacher.forward_logprobs(
            micro_batches, temperature=session.cfg.actor.temperature
        )
    return served_logprobs(session.teacher_scorer, micro_batches)


def _dp_sum(t: torch.Tensor, mesh) -> torch.Tensor:
    """``t`` summed over the DP ranks (every rank of one DP replica holds the same data)."""
    if mesh.dims.dp > 1 and dist.is_initialized():
        t = t.to(mesh.device)
        dist.all_reduce(t, group=mesh.dp_group)
    return t.cpu()


def opd_step(session, micro_batches: list) -> tuple[list, dict]:
    """With ``algorithm.opd`` on: new micro-batches with ``teacher_logprobs`` attached and the
    OPD advantages (``pure``: replaced, ``add``: outcome + term; after GRPO / GAE
    normalisation), and the statistics ``opd/reverse_kl`` (mean over the step's loss tokens,
    all DP ranks, of ``prox_logprobs − teacher_logprobs``), ``opd/abs_log_ratio`` (mean
    absolute value) and ``time/teacher``. With OPD off: the inputs and ``{}``. Needs
    ``prox_logprobs`` attached; collective over the trainer ranks."""
    alg = session.cfg.algorithm
    if alg.opd == "off":
        return micro_batches, {}
    t0 = time.time()
    mbs = batches.attach(micro_batches, teacher_logprobs=teacher_logprobs(session, micro_batches))
    mbs, refused = refuse_bad_teacher_rows(mbs)  # NaN/inf or > 0: the sequence is dropped
    for sid, why in refused:
        log.warning(
            "refused sample %r: %s (the teacher's answer); dropped from this step's "
            "loss, the run goes on",
            sid,
            why,
        )
    advs, sums = [], torch.zeros(3, dtype=torch.float64)
    for mb in mbs:
        advs.append(
            opd_advantages(
                mb["advantages"],
                mb["prox_logprobs"],
                mb["teacher_logprobs"],
                mb["loss_mask"],
                mode=alg.opd,
                coef=alg.opd_coef,
            )
        )
        sums += reverse_kl_sums(mb["prox_logprobs"], mb["teacher_logprobs"], mb["loss_mask"])
    sums = torch.cat([sums, torch.tensor([float(len(refused))], dtype=torch.float64)])
    total, total_abs, n, n_refused = _dp_sum(sums, session.mesh).tolist()
    mbs = batches.attach(mbs, advantages=advs)
    n_safe = max(n, 1.0)
    stats = {
        "opd/reverse_kl": total / n_safe,
        "opd/abs_log_ratio": total_abs / n_safe,
        "time/teacher": time.time() - t0,
    }
    if n_refused:
        stats.update({"refused/teacher": n_refused, "opd/refused_samples": n_refused})
    return mbs, stats
