"""Model FLOPs of bench/vs_trl/run.py's work, and this machine's matmul peak to hold them against.

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

import time


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
