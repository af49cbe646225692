"""One rank of the 2-rank checkpoint/conversion tests (launched by
tests/helpers/conversions.py :func:`launch_2ranks`).

    python -m tests.helpers.mp_checkpoint_worker RANK WORLD PORT WORKDIR SCENARIO CONVDIR

Scenarios: ``dense`` (converted Qwen2 / Llama checkpoints: logits vs transformers at TP1 and
TP2, live export bit-exact at TP1/TP2/PP2; training checkpoint resume and TP1 -> TP2 reshard)
and ``moe`` (converted Qwen3-MoE, GLM-4 MoE and DeepSeek-V3: logits and export at EP2 and TP2,
Qwen3-MoE's also at TP2 with the experts at expert TP 1; export at PP2; a training checkpoint
with the distributed optimizer saved at one expert TP or EP and resumed at the other).
CONVDIR holds tests/helpers/convert_worker.py's output. Writes WORKDIR/SCENARIO_rank{RANK}.json.
"""

import json
import os
import sys
import time
from pathlib import Path


def main(rank, world, port, work, scenario, convdir):
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
    )
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from areal_mega.checkpoint import export
    from areal_mega.checkpoint import hf_mapping as hm
    from areal_mega.checkpoint.dist_ckpt import load_checkpoint
    from areal_mega.checkpoint.safetensors_io import SafetensorsDir
    from areal_mega.models.builder import build_model_chunks
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh

    work = Path(work)
    res = {"checks": {}}
    t0 = time.time()

    def mesh_for(vpp=None, sp=False, **dims):
        return ParallelMesh.create(
            ParallelDims(**dims), vpp=vpp, sequence_parallel=sp, timeout_s=90
        )

    def hf_logits(hf_dir, ids):
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            return m(input_ids=ids).logits

    def mc_logits(chunks, ids, vocab):
        pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
        was_training = chunks[0].training
        chunks[0].eval()
        with torch.no_grad():
            out = chunks[0](input_ids=ids, position_ids=pos, attention_mask=None)
        chunks[0].train(was_training)
        g = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(g))]
        dist.all_gather(parts, out.contiguous(), group=g)
        return torch.cat(parts, dim=-1)[..., :vocab]

    def export_check(chunks, arch, ref):
        got = {}
        for bucket in export.iter_hf_buckets(chunks, arch, bucket_bytes=64 << 10):
            got.update(bucket)
        bad = [
            n
            for n, t in got.items()
            if n not in ref or t.dtype != ref[n].dtype or not torch.equal(t, ref[n])
        ]
        names = [None] * world
        dist.all_gather_object(names, sorted(got))
        union = set().union(*map(set, names))
        return {"bad": bad, "missing": sorted(set(ref) - union), "n": len(got)}

    def ids_for(vocab):
        g = torch.Generator().manual_seed(0)
        return torch.randint(3, vocab, (2, 24), generator=g)

    def conv(name):
        return Path(convdir) / name

    def run_model_checks(name, layouts, logits_layouts):
        hf_dir = conv(name) / "hf"
        arch = hm.read_arch(hf_dir)
        sd = SafetensorsDir(hf_dir)
        ref = {n: sd.get(n) for n in sd.keys()}
        ids = ids_for(arch.vocab_size)
        want = hf_logits(hf_dir, ids)
        for dims in layouts:
            tag = f"{name}:{layout_tag(dims)}"
            mesh = mesh_for(**dims)
            chunks, _ = build_model_chunks(arch, mesh, seed=123)
            info = load_checkpoint(conv(name) / "mcore", chunks)
            c = {"iteration": info.iteration, "export": export_check(chunks, arch, ref)}
            if dims in logits_layouts:
                got = mc_logits(chunks, ids, arch.vocab_size)
                c["logits_max_abs_diff"] = float((got - want).abs().max())
            res["checks"][tag] = c
            mesh.destroy()

    if scenario == "dense":
        run_model_checks(
            "qwen2_untied_bias", [dict(dp=2), dict(tp=2), dict(pp=2)], [dict(dp=2), dict(tp=2)]
        )
        run_model_checks("llama_tied_gqa", [dict(tp=2), dict(pp=2)], [dict(tp=2)])
        run_model_checks("llama_4layers_vpp", [dict(pp=2, vpp=2), dict(tp=2)], [dict(tp=2)])
        res["resume"] = resume_and_reshard(
            work, rank, mesh_for, conv("qwen3_tied_qknorm"), mc_logits, ids_for, export
        )
        res["resume_distopt"] = resume_and_reshard(
            work,
            rank,
            mesh_for,
            conv("qwen3_tied_qknorm"),
            mc_logits,
            ids_for,
            export,
            distopt=True,
        )
        # use_distributed_optimizer switched between save and resume, fp32 and bf16
        for dtype in ("fp32", "bf16"):
            a, b = dict(dp=2, distopt=False, dtype=dtype), dict(dp=2, dtype=dtype)
            for x, y in ((a, b), (b, a)):
                res[f"resume {setting_tag(x)} -> {setting_tag(y)}"] = resume_across(
                    work, rank, mesh_for, conv("qwen3_tied_qknorm"), export, x, y
                )
    elif scenario == "moe":
        run_model_checks(
            "qwen3_moe_untied",
            [dict(dp=2, ep=2), dict(tp=2), dict(pp=2), dict(dp=2), dict(tp=2, etp=1)],
            [dict(dp=2, ep=2), dict(tp=2), dict(dp=2), dict(tp=2, etp=1)],
        )
        run_model_checks(
            "glm4_moe", [dict(dp=2, ep=2), dict(tp=2), dict(pp=2)], [dict(dp=2, ep=2), dict(tp=2)]
        )
        run_model_checks(
            "deepseek_v3",
            [dict(dp=2, ep=2), dict(tp=2), dict(pp=2)],
            [dict(dp=2, ep=2), dict(tp=2)],
        )
        # TP2 with SP at expert TP 2 and 1; DP2 with EP 2 and 1 (expert DP 1 and 2)
        pairs = [(dict(tp=2, sp=True), dict(tp=2, etp=1, sp=True)), (dict(dp=2, ep=2), dict(dp=2))]
        # and the optimizer switched: EP2 (experts in an optimizer of their own) <-> EP1
        pairs.append((dict(dp=2, ep=2), dict(dp=2, distopt=False)))
        for a, b in pairs + [(b, a) for a, b in pairs]:
            res[f"resume {setting_tag(a)} -> {setting_tag(b)}"] = resume_across(
                work, rank, mesh_for, conv("qwen3_moe_untied"), export, a, b
            )
    res["seconds"] = time.time() - t0
    (work / f"{scenario}_rank{rank}.json").write_text(json.dumps(res, indent=2, default=str))
    dist.barrier()
    dist.destroy_process_group()


def trainer(arch, mesh, seed, distopt, dtype="fp32"):
    """The trainer's DDP model (``dtype`` parameters), Adam optimizer (``distopt``: the
    distributed one) and LR schedule of ``arch`` on ``mesh``, built by the engine's own builders
    (:mod:`areal_mega.engine.optim`): 2 warm-up steps, then cosine decay to 1e-4 by step 10."""
    from areal_mega.config import OptimizerConfig
    from areal_mega.engine.optim import build_lr_scheduler, build_optimizer, wrap_ddp
    from areal_mega.models.builder import build_model_chunks

    chunks, cfg = build_model_chunks(arch, mesh, seed=seed, dtype=dtype)
    oc = OptimizerConfig(
        lr=1e-3,
        min_lr=1e-4,
        weight_decay=0.01,
        clip_grad=0.0,
        warmup_steps=2,
        lr_schedule="cosine",
        lr_decay_steps=10,
        use_distributed_optimizer=distopt,
    )
    ddp = wrap_ddp(cfg, chunks, mesh.pg_collection, distopt)
    opt = build_optimizer(oc, cfg, ddp, distopt, mesh.pg_collection)
    return ddp, opt, build_lr_scheduler(opt, oc, total_train_steps=None)


def train_step(ddp, opt, sched, ids):
    """One step of next-token loss on ``ids``: gradients reduced, optimizer and schedule
    stepped; returns (loss, whether the step was taken)."""
    import torch
    from megatron.core.distributed import finalize_model_grads

    for m in ddp:
        m.zero_grad_buffer()
    opt.zero_grad()
    pos = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    labels = torch.roll(ids, -1, dims=1)
    loss = (
        ddp[0](input_ids=ids, position_ids=pos, attention_mask=None, labels=labels).float().mean()
    )
    loss.backward()
    finalize_model_grads(ddp)  # DP reduce + TP all-reduce of q/k-norm grads
    ok, gnorm, _ = opt.step()
    sched.step(1)
    return float(loss), ok


def layout_tag(dims: dict) -> str:
    """``dict(tp=2, etp=1)`` -> ``"tp2,etp1"``: a mesh's name in the results."""
    return ",".join(f"{k}{v}" for k, v in dims.items() if k != "sp")


def mesh_dims(setting: dict) -> dict:
    """:func:`resume_across`'s setting less its optimizer kind and dtype: mesh_for keywords."""
    return {k: v for k, v in setting.items() if k not in ("distopt", "dtype")}


def setting_tag(setting: dict) -> str:
    """:func:`resume_across`'s setting by name: its mesh (:func:`layout_tag`), ``regular`` for
    the regular optimizer, its dtype when not fp32: ``dict(dp=2, distopt=False)`` ->
    ``"dp2,regular"``."""
    parts = [layout_tag(mesh_dims(setting))]
    if not setting.get("distopt", True):
        parts.append("regular")
    if setting.get("dtype", "fp32") != "fp32":
        parts.append(setting["dtype"])
    return ",".join(parts)


def resume_across(work, rank, mesh_for, conv_dir, export, save, resume):
    """Training resumed in another setting: one step in the setting ``save``, save, a second
    step; a fresh model resumed from the save in the setting ``resume`` takes the same second
    step. A setting is a mesh (mesh_for keywords: another expert TP or EP, whose weights and
    Adam state reshard over the experts' other groups, megatron's optimizer chain split or
    merged) with ``distopt`` (the distributed optimizer, default; False: the regular one, whose
    state the other kind loads by key) and ``dtype`` (default fp32). Returns the largest
    difference of the exported weights after it, the second step's own largest change of an
    expert weight, or of any weight without experts (the check is not vacuous), and whether
    the optimizer state loaded."""
    import torch

    from areal_mega.checkpoint import hf_mapping as hm
    from areal_mega.checkpoint.dist_ckpt import load_checkpoint, save_checkpoint

    arch = hm.read_arch(conv_dir / "hf")
    root = work / f"ckpt_{conv_dir.name}_{setting_tag(save)}_to_{setting_tag(resume)}"

    def batch(step, dims):  # a DP rank's own tokens; the same tokens on both TP ranks
        g = torch.Generator().manual_seed(300 + 10 * step + (rank if dims.get("dp") else 0))
        return torch.randint(3, arch.vocab_size, (2, 16), generator=g)

    def make(setting, seed):
        dims = mesh_dims(setting)
        mesh = mesh_for(**dims)
        kind = dict(distopt=setting.get("distopt", True), dtype=setting.get("dtype", "fp32"))
        return mesh, dims, *trainer(arch, mesh, seed, **kind)

    mesh, dims, ddp, opt, sched = make(save, 7)
    load_checkpoint(conv_dir / "mcore", ddp)
    train_step(ddp, opt, sched, batch(0, dims))
    save_checkpoint(root, 1, ddp, opt, sched, hf_dir=conv_dir / "hf")
    saved = {k: v.clone() for k, v in export.iter_hf_tensors(ddp, arch)}
    train_step(ddp, opt, sched, batch(1, dims))
    want = {k: v.clone() for k, v in export.iter_hf_tensors(ddp, arch)}
    mesh.destroy()
    del ddp, opt, sched

    mesh, dims, ddp, opt, sched = make(resume, 31)
    info = load_checkpoint(root, ddp, opt, sched)
    train_step(ddp, opt, sched, batch(1, dims))
    got = dict(export.iter_hf_tensors(ddp, arch))
    mesh.destroy()
    experts = [k for k in want if ".experts." in k]
    return {
        "max_abs_diff": max(float((got[k] - want[k]).abs().max()) for k in want if k in got),
        "names_equal": sorted(got) == sorted(want),
        "step_change": max(float((want[k] - saved[k]).abs().max()) for k in experts or want),
        "n_expert_tensors": len(experts),
        "loaded_optimizer": info.loaded_optimizer,
    }


def resume_and_reshard(work, rank, mesh_for, conv_dir, mc_logits, ids_for, export, distopt=False):
    """Train one step at TP1 (DP2), save, train another; a fresh model resumed from the save
    must give bit-identical weights after the same step. Then load the save at TP2 and compare
    logits and exported weights with the TP1 model at save time."""
    import torch
    import torch.distributed as dist

    from areal_mega.checkpoint import hf_mapping as hm
    from areal_mega.checkpoint.dist_ckpt import (
        find_latest,
        latest_verified,
        load_checkpoint,
        save_checkpoint,
    )
    from areal_mega.models.builder import build_model_chunks

    arch = hm.read_arch(conv_dir / "hf")
    root = work / ("train_ckpt_distopt" if distopt else "train_ckpt")
    out = {}

    def batch(step, r=None):
        g = torch.Generator().manual_seed(100 + 10 * step + (rank if r is None else r))
        return torch.randint(3, arch.vocab_size, (2, 16), generator=g)

    def make(seed, mesh):
        return trainer(arch, mesh, seed, distopt)

    def params(ddp):
        return [p.detach().clone() for p in ddp[0].module.parameters()]

    mesh = mesh_for(dp=2)
    ddp, opt, sched = make(7, mesh)
    load_checkpoint(conv_dir / "mcore", ddp)  # start from the converted weights
    train_step(ddp, opt, sched, batch(0))
    ids = ids_for(arch.vocab_size)
    logits_w1 = mc_logits([ddp[0].module], ids, arch.vocab_size)
    export_w1 = {k: v.clone() for k, v in export.iter_hf_tensors(ddp, arch)}
    t = time.time()
    path = save_checkpoint(
        root,
        1,
        ddp,
        opt,
        sched,
        extra={"version": 1, "data_pos": 7},
        hf_dir=conv_dir / "hf",
        keep_last=2,
    )
    out["save_seconds"] = time.time() - t
    from areal_mega.checkpoint import checksums as cks

    files = json.loads((path / "areal_meta.json").read_text())["checksums"]["files"]
    out["checksums_cover_all_files"] = sorted(files) == cks.list_files(path) and any(
        f.startswith("__1_") for f in files
    )
    train_step(ddp, opt, sched, batch(1))
    want = params(ddp)
    export_w2 = {k: v.clone() for k, v in export.iter_hf_tensors(ddp, arch)}
    lr_want = opt.param_groups[0]["lr"]
    del ddp, opt, sched

    ddp, opt, sched = make(999, mesh)
    info = load_checkpoint(root, ddp, opt, sched)
    out["loaded"] = {
        "iteration": info.iteration,
        "extra": info.extra,
        "optimizer": info.loaded_optimizer,
        "rng": info.loaded_rng,
        "path": str(info.path),
        "latest": str(find_latest(root)),
    }
    train_step(ddp, opt, sched, batch(1))
    got = params(ddp)
    out["resume_bitexact"] = all(torch.equal(a, b) for a, b in zip(want, got))
    out["resume_max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(want, got))
    out["lr_equal"] = opt.param_groups[0]["lr"] == lr_want
    if distopt:  # optimizer state resharded DP2 x TP1 -> TP2: the same global step follows
        mesh.destroy()
        del ddp, opt, sched
        mesh = mesh_for(tp=2)
        ddp, opt, sched = make(31, mesh)
        info = load_checkpoint(root, ddp, opt, sched)
        train_step(ddp, opt, sched, torch.cat([batch(1, 0), batch(1, 1)]))
        got2 = dict(export.iter_hf_tensors(ddp, arch))
        out["opt_reshard_tp2_max_abs_diff"] = max(
            float((got2[k] - export_w2[k]).abs().max()) for k in export_w2
        )
        out["opt_reshard_loaded_optimizer"] = info.loaded_optimizer
        mesh.destroy()
        return out
    # more saves: keep_last=2 prunes; a stale .tmp and an incomplete dir are never "latest"
    proot = work / "prune_ckpt"
    for it in (1, 2, 3):
        save_checkpoint(proot, it, ddp, opt, sched, extra={"version": it}, keep_last=2)
    dist.barrier()
    if rank == 0:
        (proot / "iter_0000009.tmp").mkdir()
        (proot / "iter_0000008").mkdir()
    dist.barrier()
    out["after_prune"] = sorted(p.name for p in proot.iterdir())
    out["latest_after_junk"] = find_latest(proot).name
    # bytes flipped in a shard rank 1 wrote: both ranks agree to fall back to iteration 2
    if rank == 0:
        shard = proot / "iter_0000003" / "__1_0.distcp"
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size // 2)
            b = f.read(8)
            f.seek(shard.stat().st_size // 2)
            f.write(bytes(x ^ 0xFF for x in b))
    dist.barrier()
    back = latest_verified(proot)
    out["fallback"] = {
        "path": back.name,
        "iteration": load_checkpoint(back, ddp, opt).iteration,
        "dirs": sorted(p.name for p in proot.iterdir()),
    }
    mesh.destroy()
    del ddp, opt, sched

    mesh = mesh_for(tp=2)
    chunks, _ = build_model_chunks(arch, mesh, seed=5)
    info = load_checkpoint(path, chunks)  # model only, TP1 -> TP2
    logits_t2 = mc_logits(chunks, ids, arch.vocab_size)
    export_t2 = dict(export.iter_hf_tensors(chunks, arch))
    out["reshard"] = {
        "logits_max_abs_diff": float((logits_t2 - logits_w1).abs().max()),
        "export_bitexact": sorted(export_t2) == sorted(export_w1)
        and all(torch.equal(export_t2[k], export_w1[k]) for k in export_w1),
        "export_diff": {
            k: float((export_t2[k] - export_w1[k]).abs().max())
            for k in export_w1
            if k in export_t2 and not torch.equal(export_t2[k], export_w1[k])
        },
        "export_names_only_one_side": sorted(set(export_t2) ^ set(export_w1)),
        "rng_restored": info.loaded_rng,
    }
    # a checkpoint written by TP2 training ranks (chunks are TP shards) for the HF exporter
    save_checkpoint(work / "tp2_ckpt", 5, chunks, hf_dir=conv_dir / "hf")
    if rank == 0:
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in export_t2.items()}, str(work / "tp2_ref.safetensors")
        )
    dist.barrier()
    mesh.destroy()
    return out


if __name__ == "__main__":
    main(
        int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6]
    )
