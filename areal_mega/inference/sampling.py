"""SGLang's sampling parameters and the per-step token choice of the batched CPU engine.

One decode step turns the batch's last-position logits ``[B, V]`` into one token per row, in
SGLang's order (its ``SamplingBatchInfo.apply_logits_bias`` then ``Sampler.forward``):

1. penalties on the counts of the tokens *generated so far* by that row (the prompt does not
   count): ``logits -= frequency_penalty * count``, ``logits -= presence_penalty * (count > 0)``,
   then the CTRL-style repetition penalty on every token seen (``logit / p`` where the logit is
   positive, ``logit * p`` where negative);
2. ``min_new_tokens``: while a row has generated fewer tokens, its stop token ids and the EOS
   ids get ``-inf``;
3. ``logit_bias`` is added;
4. temperature: ``logits / T``; a temperature below 1e-6 means greedy (top_k = 1, T = 1);
5. sampling from ``softmax`` restricted by top_k, then top_p (keep the smallest prefix of the
   sorted probabilities whose mass before the token is <= top_p), then min_p (drop tokens whose
   probability is below ``min_p`` times the largest).

The returned logprob of a token is, as SGLang reports it by default (without
``SGLANG_RETURN_ORIGINAL_LOGPROB``), ``log_softmax`` of the step-4 logits: after penalties,
bias and temperature, before the top-k / top-p / min-p truncation. Greedy rows report it at
temperature 1. ``-inf`` is clamped to the most negative float, as SGLang does.

Every step is vectorised over the batch. A token is drawn by inverting the cumulative
distribution at one uniform number per row (:func:`inverse_cdf_pick`); a row with a
``sampling_seed`` draws its uniform from its own generator. When every row's token depends on
its temperature alone (no penalty, bias, truncation or top logprobs: the usual RL rollout),
the whole step is one C++ pass per row (:func:`areal_mega.ops.decode.sample_rows`, same rule).

One row must not fail the batch: :func:`choose_tokens_isolated` (what the engine calls) gives a
row whose step-4 logits are not a distribution (a NaN or ``+inf`` anywhere, or every token at
``-inf``, e.g. from an enormous ``logit_bias`` divided by a small temperature) an error message
instead of a token, and if the vectorised choice still raises, retries row by row so that only
the rows that raise on their own get an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from areal_mega.ops.decode import inverse_cdf_pick, sample_rows

GREEDY_EPS = 1e-6
_NOT_A_DISTRIBUTION = (
    "sampling error: the logits after penalties, logit_bias and temperature "
    "contain NaN or infinity (not a distribution)"
)


@dataclass
class SamplingParams:
    """Validated sampling parameters of one request (SGLang field names and defaults)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop_token_ids: tuple = ()
    stop_strs: tuple = ()
    stop_str_max_len: int = 0  # longest stop string in tokens (how much tail to decode)
    ignore_eos: bool = False
    sampling_seed: Optional[int] = None
    logit_bias: dict = field(default_factory=dict)  # token id -> additive bias
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    top_logprobs_num: int = 0

    @property
    def greedy(self) -> bool:
        """Temperature below 1e-6: argmax, logprobs at temperature 1 (SGLang's rule)."""
        return self.temperature < GREEDY_EPS

    @property
    def penalised(self) -> bool:
        """Whether any generated-token penalty is active."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _output_counts(reqs: list, vocab: int) -> torch.Tensor:
    """``[B, V]`` float counts of each row's generated tokens (one scatter for the batch)."""
    longest = max(len(r.output_ids) for r in reqs)
    idx = torch.full((len(reqs), max(longest, 1)), vocab, dtype=torch.long)
    for i, r in enumerate(reqs):
        if r.output_ids:
            idx[i, : len(r.output_ids)] = torch.tensor(r.output_ids, dtype=torch.long)
    counts = torch.zeros(len(reqs), vocab + 1)
    counts.scatter_add_(1, idx, torch.ones_like(idx, dtype=counts.dtype))
    return counts[:, :vocab]


def _column(reqs: list, attr: str) -> torch.Tensor:
    return torch.tensor([float(getattr(r.params, attr)) for r in reqs]).view(-1, 1)


def adjust_logits(reqs: list, logits: torch.Tensor, eos_ids: frozenset) -> torch.Tensor:
    """Steps 1-4 of the module docstring: the logits each row's distribution is made of."""
    logits = logits.float().clone()
    B, V = logits.shape
    params = [r.params for r in reqs]
    if any(p.penalised for p in params):
        counts = _output_counts(reqs, V)
        logits -= _column(reqs, "frequency_penalty") * counts
        seen = counts > 0
        logits -= _column(reqs, "presence_penalty") * seen
        rep = _column(reqs, "repetition_penalty").expand(B, V)
        scaled = torch.where(logits < 0, logits * rep, logits / rep)
        logits = torch.where(seen, scaled, logits)
    blocked = [i for i, r in enumerate(reqs) if len(r.output_ids) < r.params.min_new_tokens]
    for i in blocked:
        ids = [t for t in set(params[i].stop_token_ids) | eos_ids if 0 <= t < V]
        if ids:
            logits[i, ids] = float("-inf")
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits[i].index_add_(0, ids, torch.tensor(list(p.logit_bias.values())))
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params]).view(-1, 1)
    return logits / temps


def _truncated_probs(reqs: list, probs: torch.Tensor):
    """Top-k, top-p, min-p on the sorted probabilities (SGLang's torch sampler); returns the
    kept sorted probabilities and their token ids."""
    B, V = probs.shape
    ps, idx = probs.sort(dim=-1, descending=True)
    ks = torch.tensor(
        [V if r.params.top_k <= 0 or r.params.top_k > V else r.params.top_k for r in reqs]
    ).view(-1, 1)
    ps[torch.arange(V).view(1, -1) >= ks] = 0.0
    top_p = _column(reqs, "top_p")
    ps[(ps.cumsum(-1) - ps) > top_p] = 0.0
    min_p = _column(reqs, "min_p")
    if bool((min_p > 0).any()):
        ps[ps < ps[:, :1] * min_p] = 0.0
    return ps, idx


def _truncates(p: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min-p removes any token for parameters ``p``."""
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def choose_tokens(reqs: list, logits: torch.Tensor, eos_ids: frozenset):
    """One token per row of ``logits`` ``[B, V]`` for requests ``reqs`` (objects with
    ``params`` and ``output_ids``, and ``generator`` for seeded rows).

    Returns ``(tokens, logprobs, top)``: token ids, the reported logprob of each (see the
    module docstring) and, per row, ``[(logprob, token_id), ...]`` of its ``top_logprobs_num``
    most likely tokens (empty when not asked for)."""
    return _choose(reqs, adjust_logits(reqs, logits, eos_ids))


def _bad_rows(z: torch.Tensor) -> list:
    """Indices of rows of ``z`` that are no distribution: NaN or +inf anywhere, or all -inf."""
    bad = torch.isnan(z).any(-1) | torch.isposinf(z).any(-1) | torch.isneginf(z).all(-1)
    return bad.nonzero().view(-1).tolist()


def choose_tokens_isolated(reqs: list, logits: torch.Tensor, eos_ids: frozenset):
    """:func:`choose_tokens`, but a row that cannot be sampled fails alone.

    Returns ``(tokens, logprobs, top, errors)``; for a failed row ``errors[i]`` is a message
    and its token is None, otherwise ``errors[i]`` is None."""
    B = len(reqs)
    if all(_temperature_only(r, logits.shape[1]) for r in reqs):
        return _choose_temperature_only(reqs, logits)
    errors: list = [None] * B
    try:
        z = adjust_logits(reqs, logits, eos_ids)
    except Exception:  # noqa: BLE001 - find the row(s) that raise
        z = None
    if z is not None:
        for i in _bad_rows(z):
            errors[i] = _NOT_A_DISTRIBUTION
    good = [i for i in range(B) if errors[i] is None]
    toks: list = [None] * B
    lps: list = [None] * B
    top: list = [[] for _ in reqs]
    if not good:
        return toks, lps, top, errors
    try:
        if z is None:
            raise RuntimeError("adjust_logits failed for the batch")
        rows = torch.tensor(good, dtype=torch.long)
        parts = [(good, _choose([reqs[i] for i in good], z.index_select(0, rows)))]
    except Exception:  # noqa: BLE001 - retry one row at a time
        parts = []
        for i in good:
            try:
                zi = adjust_logits([reqs[i]], logits[i : i + 1], eos_ids)
                if _bad_rows(zi):
                    raise ValueError("logits are not a distribution")
                parts.append(([i], _choose([reqs[i]], zi)))
            except Exception as e:  # noqa: BLE001 - this row alone fails
                errors[i] = f"sampling error: {type(e).__name__}: {e}"
    for idx, (t, lp, tp) in parts:
        for j, i in enumerate(idx):
            toks[i], lps[i], top[i] = t[j], lp[j], tp[j]
    return toks, lps, top, errors


def _choose(reqs: list, z: torch.Tensor):
    """Step 5 on adjusted logits ``z``: see :func:`choose_tokens`."""
    logp = torch.log_softmax(z, -1)
    toks = torch.argmax(z, -1)
    sampled = [i for i, r in enumerate(reqs) if not r.params.greedy and r.params.top_k != 1]
    if sampled:
        rows = torch.tensor(sampled, dtype=torch.long)
        sub = [reqs[i] for i in sampled]
        if any(_truncates(r.params, z.shape[1]) for r in sub):
            ps, idx = _truncated_probs(sub, logp[rows].exp())
        else:  # nothing to cut: draw from the full distribution, no [B, V] sort
            ps = logp[rows].exp()
            idx = torch.arange(z.shape[1]).expand(len(sampled), -1)
        u = torch.rand(len(sampled), dtype=torch.float64)
        for j, i in enumerate(sampled):
            if reqs[i].generator is not None:
                u[j] = torch.rand((), dtype=torch.float64, generator=reqs[i].generator)
        pick = inverse_cdf_pick(ps, u)
        toks[rows] = idx.gather(1, pick.view(-1, 1)).view(-1)
    floor = torch.finfo(logp.dtype).min
    lps = logp.gather(1, toks.view(-1, 1)).view(-1).clamp(min=floor).tolist()
    top: list = [[] for _ in reqs]
    kmax = max(r.params.top_logprobs_num for r in reqs)
    if kmax > 0:
        vals, ids = logp.clamp(min=floor).topk(min(kmax, logp.shape[1]), dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        for i, r in enumerate(reqs):
            k = r.params.top_logprobs_num
            top[i] = list(zip(vals[i][:k], ids[i][:k]))
    return toks.tolist(), lps, top


def _temperature_only(r, vocab: int) -> bool:
    """Whether request ``r``'s token this step depends on its temperature alone: no penalty,
    ``min_new_tokens`` reached, no ``logit_bias``, no top logprobs asked for, and nothing cut
    by top-k / top-p / min-p (or top-k = 1, which is the argmax whatever the others say)."""
    p = r.params
    return (
        not p.penalised
        and len(r.output_ids) >= p.min_new_tokens
        and not p.logit_bias
        and p.top_logprobs_num == 0
        and (p.top_k == 1 or not _truncates(p, vocab))
    )


def _choose_temperature_only(reqs: list, logits: torch.Tensor):
    """:func:`choose_tokens_isolated` for rows that pass :func:`_temperature_only`: one
    :func:`~areal_mega.ops.decode.sample_rows` call (a C++ pass per row) instead of steps 1-5
    in torch. Uniforms are drawn as :func:`_choose` draws them."""
    B = len(reqs)
    greedy = [r.params.greedy or r.params.top_k == 1 for r in reqs]
    temps = torch.tensor(
        [1.0 if r.params.greedy else r.params.temperature for r in reqs], dtype=torch.float32
    )
    u = torch.zeros(B, dtype=torch.float64)
    sampled = [i for i in range(B) if not greedy[i]]
    if sampled:
        u[sampled] = torch.rand(len(sampled), dtype=torch.float64)
        for i in sampled:
            if reqs[i].generator is not None:
                u[i] = torch.rand((), dtype=torch.float64, generator=reqs[i].generator)
    tokens, logprobs, bad = sample_rows(logits.float(), temps, u, torch.tensor(greedy))
    toks, lps = tokens.tolist(), logprobs.tolist()
    errors: list = [None] * B
    for i in bad.nonzero().view(-1).tolist():
        toks[i], lps[i] = None, None
        errors[i] = _NOT_A_DISTRIBUTION
    return toks, lps, [[] for _ in reqs], errors
