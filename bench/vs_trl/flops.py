"""Model FLOPs of bench/vs_trl/run.py's work, the FLOP/s each side achieved (from its step timers;
our rollout server's from its own counters, :func:`server_counters`), and this machine's matmul
peak to hold them against.

Counted like the usual model-FLOPs utilisation (the work the model needs, not what an
implementation happens to do: no padding, no recomputation, no prefix-cache savings), from the
HF ``config.json`` and the token counts:

* a token's forward costs ``2 x`` the matmul weights it meets (:func:`model_dims`:
  ``matmul_params``: the attention projections, the (gated) MLP -- the active experts' for an
  MoE -- and the LM head, tied or not) plus the attention itself, ``4 x layers x heads x
  head_dim`` per key it attends to (``QK^T`` and ``AV``, a multiply-add each);
* a causal sequence of ``L`` tokens: token ``i`` attends to ``i`` keys, ``(L + 1) / 2`` on
  average (:func:`causal_context`);
* training (forward + backward): ``3 x`` the forward over prompt + completion; the proximal
  forward (a separate ``prox_logprobs`` pass): ``1 x``; generation: a forward over the prompt
  (prefill) and one per generated token but the last, each attending to the tokens before it.

Norms, rotary embeddings, activations, softmax and the optimizer are left out (a few per cent
at these shapes and less for wide models). Sliding windows are not modelled (every layer
attends to the whole context)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path


def model_dims(config: dict) -> dict:
    """The numbers of an HF causal-LM ``config.json`` that :func:`forward_flops` needs:
    ``layers``, ``heads``, ``head_dim`` and ``matmul_params`` (the weights one token's forward
    multiplies with; see the module docstring). An MoE (``num_experts_per_tok`` with
    ``moe_intermediate_size``) counts its active experts, its shared expert
    (``shared_expert_intermediate_size``) and its router."""
    c = config.get("text_config") or config
    h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h  # q, k, v, o
    if c.get("num_experts_per_tok") and c.get("moe_intermediate_size"):
        experts = c.get("num_local_experts") or c.get("num_experts") or 0
        mlp = 3 * h * c["num_experts_per_tok"] * c["moe_intermediate_size"] + h * experts
        mlp += 3 * h * (c.get("shared_expert_intermediate_size") or 0)
    else:
        mlp = 3 * h * c["intermediate_size"]  # gate, up, down
    return {
        "layers": layers,
        "heads": heads,
        "head_dim": hd,
        "matmul_params": layers * (attn + mlp) + h * c["vocab_size"],
    }


def causal_context(length: float) -> float:
    """The mean number of keys a token of a causal sequence of ``length`` tokens attends to."""
    return (length + 1) / 2


def forward_flops(dims: dict, tokens: float, context: float) -> float:
    """FLOPs of the forward of ``tokens`` tokens that attend to ``context`` keys on average."""
    attention = 4 * dims["layers"] * dims["heads"] * dims["head_dim"] * context
    return tokens * (2 * dims["matmul_params"] + attention)


def step_flops(dims: dict, n_samples: float, prompt_len: float, response_len: float) -> dict:
    """One RL step's FLOPs for ``n_samples`` samples of (mean) ``prompt_len`` prompt and
    ``response_len`` completion tokens: ``train`` (forward + backward), ``prox`` (one forward,
    where the proximal log-probabilities get a pass of their own) and ``generate`` (prefill and
    decoding). Sequences are counted at the mean lengths (the attention term is quadratic in
    the length, so a spread of lengths adds a little that this leaves out)."""
    length = prompt_len + response_len
    fwd = n_samples * forward_flops(dims, length, causal_context(length))
    prefill = forward_flops(dims, prompt_len, causal_context(prompt_len))
    # the decoded tokens: all but the last generated one, the k-th attending to prompt + k keys
    decoded = max(response_len - 1, 0)
    decode = forward_flops(dims, decoded, prompt_len + (decoded + 1) / 2)
    return {"train": 3 * fwd, "prox": fwd, "generate": n_samples * (prefill + decode)}


def matmul_peak(dtype_name: str, threads: int, n: int = 1024, seconds: float = 0.5) -> float:
    """This machine's matmul FLOP/s: ``torch.matmul`` of two ``n x n`` matrices of
    ``dtype_name`` (``float32`` / ``bfloat16``) on ``threads`` torch threads, repeated for at
    least ``seconds`` after one warm-up product (best of three rounds: the machine is shared).
    Runs on the calling process's CPUs; its thread count is restored afterwards."""
    import torch

    dtype = getattr(torch, dtype_name)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        torch.matmul(a, b)
        best = 0.0
        for _ in range(3):
            reps, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < seconds / 3 or reps == 0:
                torch.matmul(a, b)
                reps += 1
            best = max(best, 2 * n**3 * reps / elapsed)
        return best
    finally:
        torch.set_num_threads(before)


def side_flops(steps: list, dims: dict, samples_per_step: int, parts: dict) -> dict:
    """Model FLOPs per step (:func:`bench.vs_trl.flops.step_flops` at each step's mean prompt
    and completion lengths; the mean over the steps after the warm-up step) and the achieved
    FLOP/s of ``parts`` (``{name: (FLOPs kind, split key)}``: the kind's FLOPs summed over
    those steps over the split timer's seconds). ``prox`` counts only where the step ran the
    proximal forward (ours' ``prox/recomputed``; TRL never does at one iteration per batch)."""
    per = []
    for r in steps[1:] or steps:
        n = r.get("n_samples") or samples_per_step
        if r.get("tokens") is None or r.get("response_len") is None:
            continue
        f = step_flops(dims, n, r["tokens"] / n - r["response_len"], r["response_len"])
        f["prox"] *= bool(r.get("prox_recomputed"))
        per.append((r, f))
    out = {
        "per_step": {
            k: sum(f[k] for _, f in per) / len(per) if per else None
            for k in ("train", "prox", "generate")
        },
        "flop_s": {},
    }
    for name, (kind, key) in parts.items():
        pairs = [(f[kind], r["split"].get(key)) for r, f in per if f[kind] and r["split"].get(key)]
        seconds = sum(t for _, t in pairs)
        out["flop_s"][name] = sum(x for x, _ in pairs) / seconds if seconds > 0 else None
    return out


def server_generation_flop_s(dims: dict, info: dict, prompt_len: float, response_len: float):
    """Our rollout server's achieved FLOP/s from its own counters (``/get_server_info``,
    summed over the servers: ``prefill_tokens`` forwarded by prefills, ``tokens_generated``, the
    ``forward_seconds`` of both): prefill tokens attend to half the mean prompt, decoded ones
    to the prompt and half the completion (``prompt_len``/``response_len``: the training
    steps' means; the counters include the held-out evaluations' requests). None without
    forward time."""
    seconds = info.get("forward_seconds", 0.0)
    if not seconds:
        return None
    flops = forward_flops(dims, info["prefill_tokens"], causal_context(prompt_len))
    flops += forward_flops(dims, info["tokens_generated"], prompt_len + (response_len + 1) / 2)
    return flops / seconds


@contextlib.contextmanager
def server_counters(run_dir: Path, period: float = 0.5):
    """While the block runs, a thread asks the rollout servers ``run_dir/rollout_servers.json``
    names for their ``/get_server_info`` every ``period`` seconds (a small JSON answer: the
    servers' own forward timers and token counters, which die with them); yields a dict that
    holds the latest answer with forward time, summed over the servers (empty before)."""
    import threading
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    last, stop = {}, threading.Event()

    def poll():
        while not stop.wait(period):
            try:
                addrs = json.loads((run_dir / "rollout_servers.json").read_text())["addrs"]
                infos = [
                    json.loads(opener.open(f"http://{x}/get_server_info", timeout=2).read())
                    for x in addrs
                ]
            except (OSError, ValueError, KeyError):
                continue  # not up yet, or going down
            seconds = sum(sum(i["forward_seconds"].values()) for i in infos)
            if seconds > 0:
                last.update(
                    forward_seconds=seconds,
                    prefill_tokens=sum(i["prefill_tokens"] for i in infos),
                    tokens_generated=sum(i["tokens_generated"] for i in infos),
                )

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield last
    finally:
        stop.set()
        thread.join()


def matmul_peaks(cpus: list, thread_counts) -> dict:
    """The matmul peak (:func:`matmul_peak`, fp32 and bf16) on ``cpus`` with each of
    ``thread_counts`` threads (those the parts of the runs use); keyed by the thread count as
    text (the JSON's keys). The calling process runs on ``cpus`` meanwhile."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        return {
            str(n): {dt: matmul_peak(dt, n) for dt in ("float32", "bfloat16")}
            for n in sorted(set(thread_counts))
        }
    finally:
        os.sched_setaffinity(0, before)


def achieved_flops(res: dict, dims: dict, samples_per_step: int, threads: dict) -> dict:
    """Each side's model FLOPs per step and achieved FLOP/s (:func:`side_flops`; ours'
    generation from its server's counters, :func:`server_generation_flop_s`) and the threads
    each part ran on (``threads``: ours' ``server`` and ``trainer``, TRL's ``trl``)."""
    out = {}
    n = samples_per_step
    if "ours" in res:
        parts = {"train": ("train", "train"), "prox": ("prox", "logprobs")}
        f = side_flops(res["ours"]["steps"], dims, n, parts)
        s = res["ours"]["summary"]
        prompt = s["tokens_per_step"] / n - s["response_len"]
        f["flop_s"]["generate"] = server_generation_flop_s(
            dims, res["ours"].get("server") or {}, prompt, s["response_len"]
        )
        t = threads["trainer"]
        f["threads"] = {"train": t, "prox": t, "generate": threads["server"]}
        out["ours"] = f
    if res.get("trl") and res["trl"]["steps"] and "response_len" in res["trl"]["steps"][0]:
        parts = {"train": ("train", "train"), "generate": ("generate", "generate")}
        f = side_flops(res["trl"]["steps"], dims, n, parts)
        f["threads"] = {"train": threads["trl"], "generate": threads["trl"]}
        out["trl"] = f
    return out
