"""The process-group mesh: the ONE place that creates torch.distributed process groups.

:class:`ParallelMesh` initialises ``torch.distributed`` (NCCL on GPU, gloo on CPU) and
megatron-core's parallel state for a trainer layout ``ParallelDims(dp, tp, pp, cp, ep)`` (from
:func:`areal_mega.parallel.allocation.parse_allocation`), and hands the groups to everything
else explicitly: ``mesh.tp_group``, ``mesh.pp_group``, ..., and ``mesh.pg_collection`` (the
megatron-core ``ProcessGroupCollection`` that models, DDP, optimizers and schedules accept).

Rank order is megatron's ``tp-cp-ep-dp-pp`` (TP fastest). Expert parallelism carves the
expert-parallel group out of DP·CP with expert-tensor-parallel size = TP (megatron's default),
which is why ``ep`` must divide ``dp·cp``; with the experts' own tensor parallel size
(``dims.etp``, MoE parallel folding) megatron lays the experts over a stage's d·t·c ranks as
``etp-ep-dp`` instead, so ``etp·ep`` must divide ``dp·tp·cp``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from areal_mega.compat.megatron_import import import_megatron_core
from areal_mega.parallel.allocation import ParallelDims

__all__ = ["ParallelMesh", "init_distributed", "RANK_ORDER"]

#: megatron-core's rank order, fastest first (passed to ``initialize_model_parallel``).
RANK_ORDER = "tp-cp-ep-dp-pp"


def init_distributed(
    *,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
    init_method: Optional[str] = None,
) -> None:
    """Initialise the default process group once (env:// unless ``init_method`` is given; a
    single rank without ``MASTER_PORT`` uses a port the OS picks).

    ``backend`` defaults to NCCL when CUDA is available, gloo otherwise. A short ``timeout_s``
    makes a crashed peer fail collectives instead of hanging them."""
    if dist.is_initialized():
        return
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    if init_method is None and world_size == 1 and "MASTER_PORT" not in os.environ:
        # one rank started without torchrun: its store on a port the OS picks, never a fixed
        # one another process on the machine may hold
        init_method = "tcp://127.0.0.1:0"
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        init_method = "env://"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def megatron_groups() -> list:
    """The process groups megatron's parallel state holds now (each once; not the default
    group)."""
    from megatron.core import parallel_state as ps

    groups = []
    for name, value in vars(ps).items():
        if not name.startswith("_"):
            continue
        if isinstance(value, dict):
            value = list(value.values())
        for g in value if isinstance(value, (list, tuple)) else (value,):
            if (
                isinstance(g, dist.ProcessGroup)
                and g is not dist.group.WORLD
                and not any(g is h for h in groups)
            ):
                groups.append(g)
    return groups


@dataclass
class ParallelMesh:
    """Process groups and coordinates of this rank in the 5-D trainer mesh.

    Build with :meth:`ParallelMesh.create`; tear down with :meth:`destroy`.
    """

    dims: ParallelDims
    vpp: Optional[int]
    device: torch.device
    sequence_parallel: bool
    pg_collection: object = field(repr=False)
    rank: int = 0
    world_size: int = 1
    groups: list = field(default_factory=list, repr=False)  # megatron's, made for this mesh

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        dims: ParallelDims,
        *,
        vpp: Optional[int] = None,
        sequence_parallel: bool = False,
        backend: Optional[str] = None,
        timeout_s: float = 600.0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        init_method: Optional[str] = None,
    ) -> "ParallelMesh":
        """Initialise torch.distributed (if needed) and megatron's parallel state for ``dims``.

        On CPU the megatron-core compatibility patches are applied first. ``vpp`` is the
        number of virtual pipeline chunks per stage (None or 1: no interleaving)."""
        import_megatron_core()
        if not torch.cuda.is_available():
            from areal_mega.compat import megatron_cpu

            megatron_cpu.apply()
        init_distributed(
            backend=backend,
            timeout_s=timeout_s,
            rank=rank,
            world_size=world_size,
            init_method=init_method,
        )
        ws = dist.get_world_size()
        if ws != dims.world_size:
            raise ValueError(
                f"trainer layout {dims.short()} needs {dims.world_size} ranks, "
                f"torch.distributed has {ws}"
            )
        if (dims.dp * dims.cp) % dims.ep and dims.etp is None:
            raise ValueError(
                f"expert parallel size e={dims.ep} must divide d*c={dims.dp * dims.cp}"
            )
        if (dims.dp * dims.tp * dims.cp) % (dims.expert_tp * dims.ep):
            raise ValueError(
                f"trainer layout {dims.short()}: the experts' t*e = {dims.expert_tp}*{dims.ep} "
                f"must divide a stage's d*t*c = {dims.dp * dims.tp * dims.cp}"
            )
        if sequence_parallel and dims.tp == 1:
            sequence_parallel = False
        if vpp is not None and vpp <= 1:
            vpp = None
        if vpp is not None and dims.pp == 1:
            raise ValueError("virtual pipeline parallelism needs p > 1")
        from megatron.core import parallel_state as ps
        from megatron.core.process_groups_config import ProcessGroupCollection

        if ps.model_parallel_is_initialized():
            # another mesh's state (e.g. a converter's mesh inside a trainer): forgotten here,
            # its groups stay alive for their owner, which destroys them
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tensor_model_parallel_size=dims.tp,
            pipeline_model_parallel_size=dims.pp,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=dims.cp,
            expert_model_parallel_size=dims.ep,
            expert_tensor_parallel_size=dims.expert_tp,
            distributed_timeout_minutes=max(1, int(timeout_s // 60)),
            create_gloo_process_groups=torch.cuda.is_available(),
            order=RANK_ORDER,
        )
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        groups = megatron_groups()
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        return cls(
            dims=dims,
            vpp=vpp,
            device=device,
            sequence_parallel=sequence_parallel,
            pg_collection=pgc,
            rank=dist.get_rank(),
            world_size=ws,
            groups=groups,
        )

    def destroy(self, *, process_group: bool = False) -> None:
        """Destroy this mesh: megatron's parallel state when it is this mesh's, and the
        process groups made for it (and the default group when asked).

        ``parallel_state.destroy_model_parallel`` alone only forgets the groups: each would
        stay registered with torch.distributed with its gloo threads alive (about 60 threads
        per mesh, some busy in their TCP loops), and a process that builds mesh after mesh
        (a test of layouts, a re-mesh) would accumulate them."""
        from megatron.core import parallel_state as ps

        current = megatron_groups()
        if not self.groups or any(g is h for g in current for h in self.groups):
            ps.destroy_model_parallel()
        if dist.is_initialized():
            for g in self.groups:
                if g is not dist.GroupMember.NON_GROUP_MEMBER:
                    dist.destroy_process_group(g)
        self.groups = []
        _clear_rotary_caches()
        if process_group and dist.is_initialized():
            dist.destroy_process_group()

    # -- groups ---------------------------------------------------------------------------
    @property
    def tp_group(self):
        return self.pg_collection.tp

    @property
    def pp_group(self):
        return self.pg_collection.pp

    @property
    def cp_group(self):
        return self.pg_collection.cp

    @property
    def dp_group(self):
        """Data-parallel group without context parallelism."""
        return self.pg_collection.dp

    @property
    def dp_cp_group(self):
        """Data × context parallel group: where dense gradients are reduced."""
        return self.pg_collection.dp_cp

    @property
    def ep_group(self):
        return self.pg_collection.ep

    @property
    def mp_group(self):
        """Model-parallel group (TP × PP): the ranks that share one model replica."""
        return self.pg_collection.mp

    # -- coordinates ----------------------------------------------------------------------
    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.tp_group)

    @property
    def pp_rank(self) -> int:
        return dist.get_rank(self.pp_group)

    @property
    def dp_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    @property
    def cp_rank(self) -> int:
        return dist.get_rank(self.cp_group)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.dims.pp - 1

    def dp_ranks_by_global_rank(self) -> list[int]:
        """The data-parallel rank of every global rank (index = global rank); no collective.

        Computed with megatron-core's own ``RankGenerator`` in the order :meth:`create` passes
        (:data:`RANK_ORDER`; dense groups have ep = 1), so it names the same
        DP groups as ``mesh.dp_group`` on each rank."""
        from megatron.core.parallel_state import RankGenerator

        d = self.dims
        gen = RankGenerator(tp=d.tp, ep=1, dp=d.dp, pp=d.pp, cp=d.cp, order=RANK_ORDER)
        out = [0] * self.world_size
        for group in gen.get_ranks("dp"):
            for dp_rank, global_rank in enumerate(group):
                out[global_rank] = dp_rank
        return out

    def last_stage_global_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        ranks = dist.get_process_group_ranks(self.pp_group)
        return ranks[-1]

    @property
    def is_cpu(self) -> bool:
        return self.device.type == "cpu"


def _clear_rotary_caches() -> None:
    """Empty megatron's rotary-embedding tables cache: ``RotaryEmbedding.forward`` (and YaRN's)
    is a process-wide ``lru_cache`` of 32 entries keyed by the module, each entry holding its
    module and so the module's context-parallel group, which would keep a destroyed mesh's
    groups (their gloo threads) alive."""
    from megatron.core.models.common.embeddings import (
        rotary_pos_embedding,
        yarn_rotary_pos_embedding,
    )

    for cls in (
        rotary_pos_embedding.RotaryEmbedding,
        yarn_rotary_pos_embedding.YarnRotaryEmbedding,
    ):
        clear = getattr(cls.forward, "cache_clear", None)
        if clear is not None:
            clear()
