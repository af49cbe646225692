"""Everything a trainer process holds across steps: mesh, engines, intake, logger, resume.

The training loop itself lives in :mod:`areal_mega.trainer`; this module keeps it short.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from areal_mega.common.malloc import set_training_policy
from areal_mega.config import ConfigError, ExperimentConfig, config_to_dict
from areal_mega.dataplane.control import RolloutLink
from areal_mega.lora.actor import (
    AdaptersOffReference,
    base_keys,
    check_resumed_base,
    checkpoint_extra,
    merged_deltas,
    publish_adapter,
)
from areal_mega.parallel.allocation import parse_allocation
from areal_mega.parallel.weight_group import weight_update_group
from areal_mega.rollout.routes import replay_layout
from areal_mega.run_dir import (
    SOURCE_FILE,
    RunDir,
    hf_source_identity,
    is_disk_full_error,
    iter_dir_name,
)
from areal_mega.security import holds_secret, write_run_file
from areal_mega.tracking import RunLog
from areal_mega.tracking.metrics import ProgressBar, plot_metrics
from areal_mega.train.intake import TrajectoryIntake
from areal_mega.train.nonfinite import SkipGuard
from areal_mega.train.teacher import build_teacher, build_teacher_scorer, vision_of
from areal_mega.train.weight_sender import broadcast_version, connect_weight_sender
from areal_mega.train.weights import export_hf_dir, resolve_weight_update, vl_hf_tensors

log = logging.getLogger(__name__)


_CONVERT = (
    "import json, sys\n"
    "from areal_mega.checkpoint.convert import convert_hf_to_mcore\n"
    "from areal_mega.checkpoint.vl_convert import convert_vl_hf_to_mcore\n"
    "vl, kw = sys.argv[3] == 'vl', json.loads(sys.argv[4])\n"
    "(convert_vl_hf_to_mcore if vl else convert_hf_to_mcore)(sys.argv[1], sys.argv[2], **kw)\n"
)


def convert_in_child(hf_dir, out, conversion: dict, *, vision_language: bool) -> None:
    """An HF directory converted into ``out`` in a child process
    (:func:`~areal_mega.checkpoint.convert.convert_hf_to_mcore`, or
    :func:`~areal_mega.checkpoint.vl_convert.convert_vl_hf_to_mcore` for a vision-language
    model, which keeps ``dtype`` and ``make_vocab_size_divisible_by`` only): the converters build
    the model under a one-process mesh of their own and tear it down, which must not replace
    this trainer rank's (and refuse to run inside a larger process group). Written for one
    rank; any layout loads it. Raises ``RuntimeError`` with the child's last output when it
    fails."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
        and not k.startswith(("TORCHELASTIC_", "MASTER_"))
    }
    kw = dict(conversion, progress=False)
    if vision_language:
        kw = {k: conversion[k] for k in ("dtype", "make_vocab_size_divisible_by")}
    kind = "vl" if vision_language else "text"
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(hf_dir), str(out), kind, json.dumps(kw)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        what = "the vision-language model" if vision_language else "the model"
        raise RuntimeError(
            f"converting {what} {hf_dir} failed:\n" + (proc.stderr or proc.stdout)[-2000:]
        )


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be saved for a reason no relaunch cures (a full disk); the
    message says which iteration and where. The previous checkpoint is intact."""


def weight_group_for(cfg: ExperimentConfig):
    """The weight-update group of ``cfg`` (rollout TP from the allocation string, one server
    per ``rollout.server_addrs`` entry): the launcher's own arithmetic,
    :func:`areal_mega.parallel.weight_group.weight_update_group`. Raises ``ConfigError``."""

    return weight_update_group(
        parse_allocation(cfg.allocation), cfg.rollout.backend, len(cfg.rollout.server_addrs)
    )


class TrainerSession:
    """Builds the mesh and engines, restores or initialises state, owns logging and I/O.

    One per trainer process: every torchrun rank of ``areal_mega.trainer`` builds one, and the
    methods below are called on every rank in the same order (most are collective). Rank 0
    (``is_rank0``) alone holds the I/O: ``intake`` (trajectories from the rollout worker, RL
    only), ``link`` (the worker's control channel), ``logger``, ``progress`` and, with
    ``rollout.weight_update=distributed``, ``weight_sender``; these are None on other ranks.
    Other attributes: ``cfg``, ``run_dir``, ``mesh``, ``layout`` (dp/tp/pp/cp sizes for
    planning), ``actor``, ``ref`` (None without ``ref.enabled``), ``teacher`` (OPD's
    in-trainer teacher, :func:`~areal_mega.train.teacher.build_teacher`, or None), ``vision``
    (a vision-language student's :class:`~areal_mega.dataplane.multimodal.VisionSpec`, or
    None: :func:`~areal_mega.train.teacher.vision_of`), ``skips``
    (the :class:`~areal_mega.train.nonfinite.SkipGuard` of non-finite steps), ``ckpt_root``,
    ``start_step`` (last completed step; 0 on a fresh run), ``weight_update``.
    """

    def __init__(self, cfg: ExperimentConfig):
        """Collective set-up on every trainer rank, in order: the parallel mesh (initialises
        torch.distributed) from ``cfg.allocation``; the actor engine (and the reference engine
        with ``ref.enabled``); resume from the latest checkpoint under ``ckpt_root`` when
        ``recover=auto`` finds one, else the initial weights (``checkpoint.load`` or
        ``model.path``, converted once to ``<run_dir>/init_mcore``); the weight-update
        method; on CPU the malloc policy of training (:mod:`areal_mega.common.malloc`). Rank 0
        then writes ``config.resolved.json``, opens the metrics logger and, in
        RL mode, starts the trajectory intake (replaying its journal when resuming) and the
        control link. A resumed RL run publishes its weights at ``start_step`` before
        returning, so the rollout servers generate with the trained weights. Raises
        :class:`~areal_mega.config.ConfigError` for an unusable ``rollout.weight_update``.
        """
        from areal_mega.engine.megatron_engine import MegatronEngine, vision_special_token_ids
        from areal_mega.parallel.mesh import ParallelMesh

        self.cfg = cfg
        self.paths = RunDir.from_config(cfg)
        try:
            self.paths.check_fresh_start(cfg.recover)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.run_dir = self.paths.root
        self.run_dir.mkdir(parents=True, exist_ok=True)
        alloc = parse_allocation(cfg.allocation)
        self.mesh = ParallelMesh.create(
            alloc.trainer,
            vpp=cfg.actor.virtual_pipeline_size,
            sequence_parallel=cfg.actor.sequence_parallel,
            timeout_s=cfg.cluster.dist_timeout_s,
        )
        self.is_rank0 = self.mesh.rank == 0
        d = alloc.trainer
        self.layout = dict(dp_size=d.dp, tp_size=d.tp, pp_size=d.pp, cp_size=d.cp)
        torch.manual_seed(cfg.seed)
        self.actor = MegatronEngine(
            cfg.model,
            role="actor",
            mesh=self.mesh,
            optimizer_cfg=cfg.optimizer,
            actor_cfg=cfg.actor,
            seed=cfg.seed,
            total_train_steps=cfg.total_steps,
            routing_replay=cfg.algorithm.routing_replay == "r3",
            lora=cfg.lora,
        )
        self.ref = None
        if cfg.ref.enabled and self.actor.lora is not None:  # the base: adapters off
            self.ref = AdaptersOffReference(self.actor)
        elif cfg.ref.enabled:
            self.ref = MegatronEngine(
                cfg.model,
                hf_config=cfg.ref.path or cfg.model.path,
                role="ref",
                mesh=self.mesh,
                seed=cfg.seed,
            )
        self.teacher = build_teacher(cfg, self.mesh)  # OPD's in-trainer teacher, or None
        # images reach every engine that runs the micro-batches, or the run is refused
        self.vision = vision_of(
            cfg,
            self.actor.hf_config,
            getattr(self.ref, "hf_config", None),
            getattr(self.teacher, "hf_config", None),
        )
        if self.vision is not None and cfg.mode == "rl":
            # the servers never sample the vision special tokens: the policy, and the
            # distributions it is compared with, leave them out
            banned = vision_special_token_ids(self.actor.hf_config)
            for eng in (self.actor, self.ref, self.teacher):
                if isinstance(eng, MegatronEngine):
                    eng.banned_token_ids = banned
        self.teacher_scorer = build_teacher_scorer(cfg, self.vision)  # OPD: a served teacher
        self.critic = None
        if cfg.critic.enabled and cfg.mode == "rl":
            from areal_mega.train.critic_step import build_critic

            self.critic = build_critic(cfg, self.mesh)
        # plan micro-batches by prompt group when every engine that runs them shares prompts
        self.layout["share_prefix"] = all(
            getattr(e, "shares_prompt_prefix", False)
            for e in (self.actor, self.ref, self.teacher, self.critic)
            if e is not None
        )
        self.ckpt_root = self.paths.checkpoint_root
        self.start_step = 0
        self.skips = SkipGuard(cfg.actor.max_consecutive_skips, cfg.algorithm.routing_replay)
        resumed = self._restore_or_init()  # the initial conversion releases its buffers
        if not torch.cuda.is_available():  # buffers up to 32 MiB are reused step after step
            set_training_policy()
        self.intake = self.link = self.logger = self.progress = self.weight_sender = None
        self.rollout_metrics: dict = {}  # the worker's rollout/* server metrics (elastic)
        try:
            self.weight_update = resolve_weight_update(
                cfg.rollout.weight_update,
                cuda=torch.cuda.is_available(),
                pp=d.pp,
                lora=cfg.lora.enabled,
            )
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.is_rank0:
            self._write_resolved_config()
            self._open_rank0_io(resumed)
        if resumed is not None and cfg.mode == "rl":
            self.publish_weights(version=self.start_step)  # servers get the resumed weights

    # ------------------------------------------------------------------ initial state
    def _restore_or_init(self) -> Optional[dict]:
        """Resume from the latest checkpoint (recover=auto) or load the initial weights."""
        from areal_mega.checkpoint.dist_ckpt import latest_verified, load_checkpoint

        cfg = self.cfg
        latest = latest_verified(self.ckpt_root) if cfg.recover == "auto" else None
        if latest is not None:
            if self.actor.lora is not None:  # the frozen base first, then the adapters
                self._load_initial(self.actor, self.cfg.model.path)
            loaded = load_checkpoint(
                latest,
                self.actor.model_chunks(),
                self.actor.optimizer,
                self.actor.lr_scheduler,
                model_keys=self.actor.checkpoint_keys,
            )
            if self.actor.lora is not None:
                check_resumed_base(loaded.extra.get("lora"), self._base_identity(), latest)
            self.start_step = int(loaded.extra.get("step", loaded.iteration))
            self.actor.step_count = self.start_step
            if self.ref is not None and self.actor.lora is None:
                self._load_initial(self.ref, self.cfg.ref.path or self.cfg.model.path)
            self._load_teacher()
            if self.critic is not None:
                from areal_mega.train.critic_step import load_critic

                load_critic(self.critic, self.ckpt_root, self.start_step)
            if self.is_rank0:
                print(f"[areal-mega] resumed from {latest} at step {self.start_step}", flush=True)
            return dict(loaded.extra, path=str(latest))
        self._load_initial(self.actor, self.cfg.model.path)
        if self.ref is not None and self.actor.lora is None:
            self._load_initial(self.ref, self.cfg.ref.path or self.cfg.model.path)
        self._load_teacher()
        if self.critic is not None:
            from areal_mega.train.critic_step import init_critic

            init_critic(
                self.critic,
                lambda views, hf: self._load_initial(views, hf, "critic"),
                self.cfg.critic.path or self.cfg.model.path,
            )
        return None

    def _load_teacher(self) -> None:
        """The in-trainer teacher's weights (fresh run and resume alike; never trained)."""
        if self.teacher is not None:
            self._load_initial(self.teacher, self.cfg.teacher.path, "teacher")

    def _load_initial(self, engine, hf_dir: str, role: str = "") -> None:
        """Initial weights: ``checkpoint.load`` (a Megatron checkpoint, actor and reference
        alike) or the HF directory ``hf_dir``, converted once into ``<run_dir>/init_mcore``
        (``init_mcore_ref`` for a reference model of its own, ``init_mcore_critic`` for a
        critic of its own); any layout loads it. ``engine``: an engine or its chunks. The
        OPD teacher (``role="teacher"``) always comes from ``hf_dir``, converted at
        ``teacher.dtype`` into ``init_mcore_teacher``."""
        from areal_mega.checkpoint.dist_ckpt import load_checkpoint

        teacher = role == "teacher"
        src = "" if teacher else self.cfg.checkpoint.load
        if not src:
            own = hf_dir != self.cfg.model.path
            src = self.paths.init_checkpoint(reference=own and engine is self.ref)
            if (own and role == "critic") or teacher:
                src = src.with_name(f"init_mcore_{role}")
            m = self.cfg.model
            conversion = dict(
                tp=self.layout["tp_size"],
                pp=self.layout["pp_size"],
                dtype=(self.cfg.teacher.dtype or m.dtype) if teacher else m.dtype,
                make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
            )
            if own and role == "critic":  # trunk only; a reward model's score head too
                conversion["value_model"] = True
            if self.mesh.dims.etp is not None:  # the experts' own TP (validated with it)
                conversion["etp"] = self.mesh.dims.etp
            identity = hf_source_identity(hf_dir, **conversion)
            current = self.paths.init_checkpoint_is_current(src, identity)  # every rank reads
            if dist.is_initialized():
                dist.barrier()  # ... before rank 0 may replace it
            if not current:
                if self.is_rank0:
                    from areal_mega.checkpoint.convert import convert_hf_to_mcore
                    from areal_mega.checkpoint.vl_convert import is_vl_model_dir

                    if src.exists():
                        print(
                            f"[areal-mega] {src} was converted from another model or "
                            f"with other settings; converting {hf_dir} again",
                            flush=True,
                        )
                        shutil.rmtree(src)
                    vl = is_vl_model_dir(hf_dir)
                    if vl or (dist.is_initialized() and dist.get_world_size() > 1):
                        # a trainer of several ranks: the converter's own one-process mesh
                        # in a child (one rank converts, any layout loads it)
                        convert_in_child(hf_dir, src, conversion, vision_language=vl)
                    else:
                        convert_hf_to_mcore(hf_dir, src, progress=False, **conversion)
                    (src / SOURCE_FILE).write_text(json.dumps(identity))
                if dist.is_initialized():
                    dist.barrier()
        chunks = engine if isinstance(engine, list) else engine.model_chunks()
        lora = getattr(engine, "lora", None)  # a LoRA actor: the base, not the adapters
        load_checkpoint(
            src,
            chunks,
            getattr(engine, "optimizer", None),  # its fp32 main params copy the weights
            load_optimizer=False,
            load_rng=False,
            model_keys=base_keys if lora is not None else None,
        )

    def _base_identity(self) -> dict:
        """What a LoRA checkpoint records of the base model (``model.path``'s files)."""
        return hf_source_identity(self.cfg.model.path)

    def _write_resolved_config(self) -> None:
        resolved = config_to_dict(self.cfg)  # 0600 when it holds a secret
        write_run_file(
            self.paths.resolved_config_file,
            json.dumps(resolved, indent=2),
            private=holds_secret(resolved),
        )

    def _open_rank0_io(self, resumed: Optional[dict]) -> None:
        cfg = self.cfg
        # recover=auto without a checkpoint starts over: the lost lineage's rows go (-1)
        self.logger = RunLog(
            cfg,
            self.run_dir,  # metrics.jsonl, trackers, samples.jsonl
            resume_step=self.start_step if resumed else (-1 if cfg.recover == "auto" else None),
        )
        if cfg.logging.progress_bar:
            self.progress = ProgressBar(
                cfg.total_steps, initial_step=self.start_step, desc=cfg.mode
            )
        if cfg.mode != "rl":
            return
        self.intake = TrajectoryIntake(
            self.paths.data_endpoint,
            self.run_dir,
            group_size=cfg.rollout.n_samples,
            secret=cfg.dataplane.secret,
            max_queue=cfg.dataplane.max_queue,
            max_message_bytes=cfg.dataplane.max_message_bytes,
            allow_remote=cfg.dataplane.allow_remote,
            route_layout=replay_layout(cfg),
            vision=self.vision,
        )
        if resumed is not None:
            buf = resumed.get("buffer_file")
            n = self.intake.restore(
                str(self.ckpt_root / buf) if buf else None,
                self.start_step,
                accepted_before=int(resumed.get("accepted_samples", 0)),
                prompt_ledger=resumed.get("accepted_prompts"),
                journal_from=resumed.get("journal_from"),
            )
            print(f"[areal-mega] journal replay: {n} accepted samples pending again", flush=True)
        self.intake.start()
        self.link = RolloutLink(
            self.paths.control_endpoint,
            secret=cfg.dataplane.secret,
            timeout_s=cfg.rollout.request_timeout_s,
        )
        if self.weight_update == "distributed":  # rank 0 joins the servers' broadcast group
            self.weight_sender = connect_weight_sender(self.cfg, weight_group_for(self.cfg))

    # ------------------------------------------------------------------ per step
    def publish_weights(self, version: int) -> None:
        """Send the actor's weights to the rollout servers and make ``version`` current.

        Collective: every trainer rank calls it (``trainer.rl_step`` after the update, with
        ``version`` = the step just trained; ``__init__`` on a resume); it returns once the
        servers serve ``version`` (after a barrier when torch.distributed is initialised).

        ``disk``: every rank takes part in the HF export, rank 0 writes the safetensors
        directory and asks the rollout worker to pause, reload, continue and bump the version.
        ``distributed``: rank 0 asks the worker to pause, broadcasts the HF-named tensors in
        buckets to every server (the other ranks take part in the TP/EP gathers), then asks
        it to continue at ``version``; a server that dies meanwhile is left out and the
        version sent again to the others
        (:func:`~areal_mega.train.weight_sender.broadcast_version`).
        """
        if self.weight_update == "distributed":
            self._publish_distributed(version)
            return

        out = self.run_dir / "weights" / f"v{version:07d}"
        lora = self.actor.lora
        if lora is not None and lora.sync == "adapter":  # a PEFT adapter of a few MiB
            publish_adapter(
                self.actor, out, base_model=self.cfg.model.path, is_writer=self.is_rank0
            )
        else:  # full weights (LoRA: merged into the base)
            export_hf_dir(
                self.actor,
                self.cfg.model.path,
                out,
                is_writer=self.is_rank0,
                deltas=merged_deltas(self.actor) if lora is not None else None,
            )
        if self.is_rank0:
            self._note_rollout(self.link.update_weights(version=version, path=str(out)))
            self._prune_weight_dirs(keep=out)
        if dist.is_initialized():
            dist.barrier()

    def _publish_distributed(self, version: int) -> None:
        from areal_mega.checkpoint import hf_mapping as hm
        from areal_mega.checkpoint.export import iter_hf_tensors
        from areal_mega.checkpoint.vl_convert import is_vl_model_dir

        if is_vl_model_dir(self.cfg.model.path):  # vision tower, projector, language model

            def stream():
                return vl_hf_tensors(self.actor, self.cfg.model.path)[0]

        else:
            arch = hm.read_arch(self.cfg.model.path)

            def stream():
                return iter_hf_tensors(self.actor.model, arch)

        # a server dying before or during the broadcast is left out and the version sent
        # again to the survivors; only a broadcast that keeps failing ends the trainer
        reply = broadcast_version(
            self.weight_sender,
            self.link,
            stream,
            version,
            agree=lambda failed: bool(self._from_rank0(int(failed))),
        )
        if self.is_rank0:
            self._note_rollout(reply)
        if dist.is_initialized():
            dist.barrier()

    def _note_rollout(self, reply: dict) -> None:
        """Keep the worker's ``rollout/*`` server metrics (live servers, resumptions,
        per-server requests / tokens) for the next metrics row."""
        self.rollout_metrics = {k: v for k, v in reply.items() if k.startswith("rollout/")}

    def _prune_weight_dirs(self, keep: Path) -> None:
        for d in sorted((self.run_dir / "weights").glob("v*")):
            if d != keep:
                shutil.rmtree(d, ignore_errors=True)

    def log(self, step: int, stats: dict) -> None:
        """Write ``stats`` as the metrics row of ``step`` (rank 0 only; a no-op elsewhere).

        Adds the intake's ``dataplane/*`` and ``buffer/*`` statistics and ``staleness/max``
        (``step − 1 −`` the oldest weight version in the batch) to ``stats`` in place, appends
        the row to ``<run_dir>/metrics.jsonl`` (fsync'd; TensorBoard too when enabled) and
        advances the progress bar. Called by the trainer's main loop after each step.
        """
        if not self.is_rank0:
            return
        if self.intake is not None:
            stats.update(self.intake.stats())
        stats.update(self.rollout_metrics)
        if "versions/min" in stats:
            stats["staleness/max"] = float(step - 1 - stats["versions/min"])
        row = self.logger.log(step, stats)
        if self.progress is not None:
            self.progress.update(step, row)

    def maybe_checkpoint(self, step: int, force: bool = False) -> None:
        """Save a full checkpoint of ``step`` if it is due: ``force``, the last step
        (``total_steps``), or a multiple of ``checkpoint.save_every`` (0 = only the last).

        Raises :class:`CheckpointSaveError` ("no space left on device while saving iter_N to
        <root>") when the disk is full, after removing the partial save, and when a weight is
        NaN/inf (nothing saved: a checkpoint never holds non-finite weights).

        Collective (every trainer rank, after :meth:`log`). Writes ``<ckpt_root>/iter_<step>``
        (model, optimizer, LR scheduler, RNG; ``extra`` = step, version, time, buffer file,
        accepted samples) and keeps the last ``checkpoint.keep_last``. In RL mode rank 0 first
        snapshots the trajectory buffer to ``buffer_iter_<step>.bin`` (starting a new journal
        segment, ``extra.journal_from``), and after the save deletes the journal segments no
        kept checkpoint needs and buffer files whose checkpoint was pruned.
        """
        every = self.cfg.checkpoint.save_every
        if not (force or step == self.cfg.total_steps or (every and step % every == 0)):
            return
        from areal_mega.checkpoint.dist_ckpt import NonFiniteWeightsError, save_checkpoint

        buf_name = f"buffer_iter_{step:07d}.bin" if self.cfg.mode == "rl" else None
        journal_from, accepted, ledger = 0, 0, None
        try:
            if self.is_rank0 and self.intake is not None:
                self.ckpt_root.mkdir(parents=True, exist_ok=True)
                journal_from, accepted, ledger = self.intake.snapshot(
                    str(self.ckpt_root / buf_name)
                )
            accepted = self._from_rank0(accepted)
            journal_from = self._from_rank0(journal_from)
            ledger = self._object_from_rank0(ledger)
            extra = {
                "step": step,
                "version": step,
                "time": time.time(),
                "buffer_file": buf_name,
                "accepted_samples": accepted,
            }
            if journal_from:  # RL: a resume from this checkpoint replays from this segment
                extra["journal_from"] = journal_from
            if self.critic is not None:  # first: every actor checkpoint has its critic
                from areal_mega.train.critic_step import save_critic

                # one more kept: a crash before the actor's save resumes the previous step
                save_critic(self.critic, self.ckpt_root, step, self.cfg.checkpoint.keep_last + 1)
            if ledger is not None:  # RL: which prompts' groups it holds (exact resume)
                extra["accepted_prompts"] = ledger
            if self.actor.lora is not None:  # adapters + optimizer; the base is model.path
                extra["lora"] = checkpoint_extra(self.actor.lora, self._base_identity())
            save_checkpoint(
                self.ckpt_root,
                step,
                self.actor.model_chunks(),
                self.actor.optimizer,
                self.actor.lr_scheduler,
                extra=extra,
                keep_last=self.cfg.checkpoint.keep_last,
                hf_dir=self.cfg.model.path,
                model_keys=self.actor.checkpoint_keys,
            )
        except (OSError, RuntimeError, CheckpointException) as e:
            nonfinite = isinstance(e, NonFiniteWeightsError)  # never NaN weights saved: fatal
            if not nonfinite and not is_disk_full_error(e, self.ckpt_root):
                raise
            self._discard_partial_save(step, buf_name)
            if nonfinite:
                raise CheckpointSaveError(str(e)) from None
            raise CheckpointSaveError(
                f"no space left on device while saving {iter_dir_name(step)} to {self.ckpt_root}"
            ) from None
        if self.is_rank0 and self.intake is not None:
            self.intake.after_checkpoint(self.ckpt_root)

    def _discard_partial_save(self, step: int, buf_name: Optional[str]) -> None:
        """Remove what a failed save of ``step`` left (``iter_N.tmp``, its buffer snapshot),
        freeing the space; the previous checkpoint and ``latest`` are untouched."""
        if not self.is_rank0:
            return
        shutil.rmtree(self.ckpt_root / (iter_dir_name(step) + ".tmp"), ignore_errors=True)
        if buf_name and not (self.ckpt_root / iter_dir_name(step)).is_dir():
            for f in self.ckpt_root.glob(buf_name + "*"):
                f.unlink(missing_ok=True)

    def _from_rank0(self, value: int) -> int:
        """Rank 0's integer on every rank (checkpoint metadata must agree across ranks)."""
        if not dist.is_initialized() or self.mesh.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.broadcast(t, src=0)
        return int(t.item())

    def _object_from_rank0(self, value):
        """Rank 0's picklable ``value`` on every rank."""
        if not dist.is_initialized() or self.mesh.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def finish(self) -> None:
        """End of a completed run (rank 0 only; a no-op elsewhere): plot the reward curve to
        ``<run_dir>/reward_curve.png`` when ``logging.plot`` and print where the run directory
        and metrics are. Called once after the last step; :meth:`close` still follows."""
        if not self.is_rank0:
            return
        if self.cfg.logging.plot:
            png = self.run_dir / "reward_curve.png"
            plot_metrics(self.run_dir / "metrics.jsonl", png)
            print(f"[areal-mega] reward curve: {png}")
        print(
            f"[areal-mega] run dir: {self.run_dir}\n[areal-mega] metrics: "
            f"{self.run_dir / 'metrics.jsonl'}"
        )

    def close(self) -> None:
        """Release everything, on every rank, whether the run finished or failed: close rank
        0's progress bar, intake, weight sender, control link and logger (errors are logged,
        not raised), then destroy the process group. Called from the trainer's ``finally``."""
        for obj in (
            self.progress,
            self.intake,
            self.weight_sender,
            self.link,
            self.logger,
            self.teacher_scorer,
        ):
            if obj is not None:
                try:
                    obj.close()
                except Exception as e:  # noqa: BLE001 - best effort on the way out
                    log.warning("closing %s: %s", type(obj).__name__, e)
        if dist.is_initialized():
            dist.destroy_process_group()
