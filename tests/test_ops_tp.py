"""Vocab-parallel packed_logprobs over gloo (TP=2) equals the TP=1 result, for both backends.

One 2-process launch runs every check; each rank saves its results and the parent compares.
"""

import os

import torch
import torch.multiprocessing as mp

from areal_mega.common.net import free_port
from tests.helpers.cpu_extension import ensure_cpu_extension

T, V, TP = 40, 3002, 2
CASES = [
    (backend, dtype, temp)
    for backend in ("native", "torch")
    for dtype in (torch.float32, torch.bfloat16)
    for temp in (1.0, 0.6)
]


def _data(dtype):
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(T, V, generator=g) * 4).to(dtype)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[0], labels[1], labels[2] = V // TP - 1, V // TP, -1  # shard edges and padding
    g_lp = torch.randn(T, generator=g)
    g_ent = torch.randn(T, generator=g)
    hidden = torch.randn(T, 16, generator=g)
    weight = torch.randn(V, 16, generator=g) / 3
    return logits, labels, g_lp, g_ent, hidden, weight


def _run_case(logits, labels, g_lp, g_ent, temp, group):
    from areal_mega.ops import packed_logprobs

    x = logits.clone().requires_grad_()
    lp, ent = packed_logprobs(x, labels, temperature=temp, tp_group=group, return_entropy=True)
    (lp * g_lp).sum().add((ent * g_ent).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


def _worker(rank, port, out_dir):
    from datetime import timedelta

    import torch.distributed as dist

    from areal_mega.ops import packed_logprobs_from_hidden

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=TP,
        timeout=timedelta(seconds=60),
    )
    try:
        results = {}
        shard = slice(rank * V // TP, (rank + 1) * V // TP)
        for i, (backend, dtype, temp) in enumerate(CASES):
            os.environ["AREAL_MEGA_OPS_BACKEND"] = backend
            logits, labels, g_lp, g_ent, hidden, weight = _data(dtype)
            results[i] = _run_case(
                logits[:, shard].contiguous(), labels, g_lp, g_ent, temp, dist.group.WORLD
            )
        os.environ["AREAL_MEGA_OPS_BACKEND"] = "native"
        logits, labels, g_lp, g_ent, hidden, weight = _data(torch.float32)
        results["fused"] = packed_logprobs_from_hidden(
            hidden,
            weight[shard],
            labels,
            temperature=0.9,
            tp_group=dist.group.WORLD,
            token_chunk=7,
            vocab_chunk=500,
            return_entropy=True,
        )
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_equals_tp1(tmp_path):
    ensure_cpu_extension()
    mp.start_processes(
        _worker, args=(free_port(), str(tmp_path)), nprocs=TP, start_method="spawn", join=True
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(TP)]
    for i, (backend, dtype, temp) in enumerate(CASES):
        os.environ["AREAL_MEGA_OPS_BACKEND"] = backend
        try:
            logits, labels, g_lp, g_ent, _, _ = _data(dtype)
            lp1, ent1, grad1 = _run_case(logits, labels, g_lp, g_ent, temp, None)
        finally:
            os.environ.pop("AREAL_MEGA_OPS_BACKEND")
        lp_a, ent_a, _ = ranks[0][i]
        lp_b, ent_b, _ = ranks[1][i]
        # identical on every rank, equal to TP=1
        assert torch.equal(lp_a, lp_b) and torch.equal(ent_a, ent_b), (backend, dtype, temp)
        torch.testing.assert_close(lp_a, lp1, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(ent_a, ent1, atol=2e-5, rtol=1e-5)
        assert lp_a[2] == 0
        grad_tp = torch.cat([ranks[r][i][2] for r in range(TP)], dim=1)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        torch.testing.assert_close(
            grad_tp.float(), grad1.float(), atol=tol * grad1.abs().max().item(), rtol=tol
        )
    from areal_mega.ops.reference import logprobs_naive

    _, labels, _, _, hidden, weight = _data(torch.float32)
    lp_ref, ent_ref = logprobs_naive(
        hidden.double() @ weight.double().T, labels, temperature=0.9, return_entropy=True
    )
    for r in range(TP):
        torch.testing.assert_close(ranks[r]["fused"][0].double(), lp_ref, atol=5e-5, rtol=1e-5)
        torch.testing.assert_close(ranks[r]["fused"][1].double(), ent_ref, atol=5e-5, rtol=1e-5)
