"""Model FLOPs of bench/vs_trl/run.py's work, the FLOP/s each side achieved (from its step timers;
our rollout server's from its own counters, :func:`server_counters`), and this machine's matmul
peak to hold them against.

Counted like the usual model-FLOPs utilisation (the work the model needs, not what an
implementation happens to do: no padding, no recomputation), from the HF ``config.json`` and
the token counts. The model needs each group's prompt once (its ``group`` samples share it:
the keys and values of its tokens are the same for all of them) and the LM head only where a
log-probability or a next token is read, so:

* a token's pass through the layers costs ``2 x`` the layers' matmul weights
  (:func:`model_dims`: ``matmul_params`` less ``head_params``: the attention projections, the
  (gated) MLP -- the active experts' for an MoE) plus the attention itself, ``4 x layers x
  heads x head_dim`` per key it attends to (``QK^T`` and ``AV``, a multiply-add each); a
  position whose logits are read adds ``2 x head_params`` (the LM head, tied or not);
* a causal sequence of ``L`` tokens: token ``i`` attends to ``i`` keys, ``(L + 1) / 2`` on
  average (:func:`causal_context`); a completion's tokens attend to the whole prompt too;
* training (forward + backward): ``3 x`` the forward of each group's prompt once and of every
  completion, the head at the completion's positions; the proximal forward (a separate
  ``prox_logprobs`` pass): ``1 x`` that forward; generation: each group's prompt once
  (prefill), then one pass per generated token but the last, the head once per generated
  token.

An implementation that computes a group's prompt once per sample (TRL) or the head at every
position does more than this and shows it as a lower fraction of the peak. Norms, rotary
embeddings, activations, softmax and the optimizer are left out (a few per cent at these
shapes and less for wide models). Sliding windows are not modelled (every layer attends to the
whole context)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path


def model_dims(config: dict) -> dict:
    """The numbers of an HF causal-LM ``config.json`` that :func:`forward_flops` needs:
    ``layers``, ``heads``, ``head_dim``, ``matmul_params`` (the weights one token's forward
    multiplies with, the LM head's included; see the module docstring) and ``head_params``
    (the LM head's). An MoE (``num_experts_per_tok`` with ``moe_intermediate_size``) counts
    its active experts, its shared expert (``shared_expert_intermediate_size``) and its
    router."""
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
        "head_params": h * c["vocab_size"],
    }


def causal_context(length: float) -> float:
    """The mean number of keys a token of a causal sequence of ``length`` tokens attends to."""
    return (length + 1) / 2


def forward_flops(dims: dict, tokens: float, context: float, head_tokens: float = None) -> float:
    """FLOPs of the forward of ``tokens`` tokens through the layers, attending to ``context``
    keys on average, and of the LM head at ``head_tokens`` positions (default: every token)."""
    head_tokens = tokens if head_tokens is None else head_tokens
    layer_params = dims["matmul_params"] - dims["head_params"]
    attention = 4 * dims["layers"] * dims["heads"] * dims["head_dim"] * context
    return tokens * (2 * layer_params + attention) + head_tokens * 2 * dims["head_params"]


def step_flops(
    dims: dict, n_samples: float, prompt_len: float, response_len: float, group: int = 1
) -> dict:
    """One RL step's FLOPs for ``n_samples`` samples of (mean) ``prompt_len`` prompt and
    ``response_len`` completion tokens, ``group`` samples per prompt: ``train`` (forward +
    backward), ``prox`` (one forward, where the proximal log-probabilities get a pass of their
    own) and ``generate`` (prefill and decoding), each group's prompt counted once (module
    docstring). Sequences are counted at the mean lengths (the attention term is quadratic in
    the length, so a spread of lengths adds a little that this leaves out)."""
    prompts = n_samples / group
    prompt = forward_flops(dims, prompts * prompt_len, causal_context(prompt_len), 0)
    completions = forward_flops(
        dims, n_samples * response_len, prompt_len + causal_context(response_len)
    )
    fwd = prompt + completions
    # the decoded tokens: all but the last generated one, the k-th attending to prompt + k
    # keys; the head reads the prefill's last position and each decoded one
    decoded = max(response_len - 1, 0)
    decode = forward_flops(
        dims, n_samples * decoded, prompt_len + (decoded + 1) / 2, n_samples * response_len
    )
    return {"train": 3 * fwd, "prox": fwd, "generate": prompt + decode}


def matmul_peak(
    dtype_name: str, threads: int, n: int = 1024, seconds: float = 0.5, backend: str = "matmul"
) -> float:
    """This machine's matmul FLOP/s: a product of two ``n x n`` matrices of ``dtype_name``
    (``float32`` / ``bfloat16``) on ``threads`` torch threads, repeated for at least
    ``seconds`` after one warm-up product (best of three rounds: the machine is shared).
    ``backend``: ``matmul`` (``torch.matmul``: MKL's sgemm for fp32, which takes only its AVX2
    path on AMD CPUs), ``onednn`` (``torch.ops.mkldnn._linear_pointwise``, the product our
    trainer's linear layers call on a CPU, :mod:`areal_mega.compat.cpu_gemm`) or ``widened``
    (bf16 on a CPU without bf16 GEMMs: the fp32 product of the widened operands rounded to
    bf16, as :func:`areal_mega.compat.cpu_gemm.linear` computes it there). Runs on the
    calling process's CPUs; its thread count is restored afterwards."""
    import torch

    dtype = getattr(torch, dtype_name)
    if backend == "matmul":
        product = torch.matmul
    elif backend == "onednn":

        def product(a, b):
            return torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")
    elif backend == "widened":
        from areal_mega.compat import cpu_gemm

        def product(a, b):
            return cpu_gemm.linear(a, b)
    else:
        raise ValueError(f"backend={backend!r}: expected matmul, onednn or widened")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        product(a, b)
        best = 0.0
        for _ in range(3):
            reps, t0 = 0, time.perf_counter()
            while (elapsed := time.perf_counter() - t0) < seconds / 3 or reps == 0:
                product(a, b)
                reps += 1
            best = max(best, 2 * n**3 * reps / elapsed)
        return best
    finally:
        torch.set_num_threads(before)


def side_flops(steps: list, dims: dict, samples_per_step: int, parts: dict, group: int = 1) -> dict:
    """Model FLOPs per step (:func:`bench.vs_trl.flops.step_flops` at each step's mean prompt
    and completion lengths, ``group`` samples per prompt; the mean over the steps after the
    warm-up step) and the achieved FLOP/s of ``parts`` (``{name: (FLOPs kind, split key)}``:
    the kind's FLOPs summed over those steps over the split timer's seconds). ``prox`` counts
    only where the step ran the proximal forward (ours' ``prox/recomputed``; TRL never does at
    one iteration per batch)."""
    per = []
    for r in steps[1:] or steps:
        n = r.get("n_samples") or samples_per_step
        if r.get("tokens") is None or r.get("response_len") is None:
            continue
        f = step_flops(dims, n, r["tokens"] / n - r["response_len"], r["response_len"], group)
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
    ``forward_seconds`` of both): prefill tokens pass the layers attending to half the mean
    prompt; generated ones pass the layers and the head, attending to the prompt and half the
    completion (``prompt_len``/``response_len``: the training steps' means; the counters
    include the held-out evaluations' requests; a request's first token, whose logits come
    from its prefill, is counted as a decoded token's layers once too). None without forward
    time."""
    seconds = info.get("forward_seconds", 0.0)
    if not seconds:
        return None
    flops = forward_flops(dims, info["prefill_tokens"], causal_context(prompt_len), 0)
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


#: The square products the peak is the best of: on a 2-core Intel Xeon with AMX, bf16 on two
#: threads reaches 1.6 TFLOP/s at 1,024 and 2.8 at 2,048 (one thread: 1.57 and 1.37).
PEAK_SIZES = (1024, 2048)


def matmul_peaks(cpus: list, thread_counts) -> dict:
    """This machine's matmul peak on ``cpus`` with each of ``thread_counts`` threads (those the
    parts of the runs use), keyed by the thread count as text (the JSON's keys): for fp32 and
    bf16 the best of :func:`matmul_peak`'s backends and of the sizes :data:`PEAK_SIZES`
    (``float32``, ``bfloat16``) and each backend's best over the sizes (``float32_by_backend``,
    ...; oneDNN's left out where this torch lacks it). bf16 on a CPU without bf16 GEMMs
    (:mod:`areal_mega.common.cpu_bf16`) is measured as the trainer computes it there, widened
    to fp32 (``widened``): torch's own bf16 product is a scalar loop there (under 1 GFLOP/s,
    minutes a size) that nothing of ours calls. The calling process runs on ``cpus``
    meanwhile."""
    import torch

    from areal_mega.common import cpu_bf16

    backends = ["matmul"]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        backends.append("onednn")
    by_dtype = {
        "float32": backends,
        "bfloat16": ["widened"] if cpu_bf16.bf16_products_in_fp32() else backends,
    }
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        out = {}
        for n in sorted(set(thread_counts)):
            peaks = {}
            for dt in ("float32", "bfloat16"):
                by = {
                    b: max(matmul_peak(dt, n, n=size, backend=b) for size in PEAK_SIZES)
                    for b in by_dtype[dt]
                }
                peaks[dt], peaks[f"{dt}_by_backend"] = max(by.values()), by
            out[str(n)] = peaks
        return out
    finally:
        os.sched_setaffinity(0, before)


def dtype_peak(peaks: dict, threads: int, dtype: str) -> float:
    """The peak (:func:`matmul_peaks`' result) on ``threads`` threads for a run of ``dtype``
    (``model.dtype``: ``bf16`` holds against the bfloat16 peak, anything else the float32
    one)."""
    return peaks[str(threads)]["bfloat16" if dtype == "bf16" else "float32"]


def achieved_flops(
    res: dict, dims: dict, samples_per_step: int, threads: dict, group: int = 1
) -> dict:
    """Each side's model FLOPs per step and achieved FLOP/s (:func:`side_flops`, ``group``
    samples per prompt; ours' generation from its server's counters,
    :func:`server_generation_flop_s`) and the threads each part ran on (``threads``: ours'
    ``server`` and ``trainer``, TRL's ``trl``)."""
    out = {}
    n = samples_per_step
    if "ours" in res:
        parts = {"train": ("train", "train"), "prox": ("prox", "logprobs")}
        f = side_flops(res["ours"]["steps"], dims, n, parts, group)
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
        f = side_flops(res["trl"]["steps"], dims, n, parts, group)
        f["threads"] = {"train": threads["trl"], "generate": threads["trl"]}
        out["trl"] = f
    return out
