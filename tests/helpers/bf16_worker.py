"""Worker of tests/test_engine_bf16.py: a bf16 actor built and loaded as the trainer does it
(one process, gloo): HF directory -> ``convert_hf_to_mcore(dtype="bf16")`` -> ``MegatronEngine``
(role ``actor``, megatron's optimizer) -> ``load_checkpoint`` with the optimizer, no optimizer
state (the session's initial load); then ``forward_logprobs`` and two ``train_batch`` steps of
the production GRPO loss. Writes what it observed as JSON: parameter, main-parameter,
gradient-buffer, logprob and loss dtypes, whether the main params hold the loaded weights, and
the largest weight change of the steps.

    python -m tests.helpers.bf16_worker HF_DIR WORK_DIR OUT_JSON
"""

import functools
import json
import sys
from pathlib import Path

import torch

from areal_mega.algo import make_policy_loss
from areal_mega.checkpoint.convert import _single_process_mesh, convert_hf_to_mcore
from areal_mega.checkpoint.dist_ckpt import load_checkpoint
from areal_mega.config import AlgorithmConfig, ModelConfig, OptimizerConfig
from areal_mega.engine import MegatronEngine
from areal_mega.scheduler.packing import pack_sequences
from areal_mega.train.batches import next_token_layout


def micro_batches(vocab: int, seed: int = 0) -> list:
    """Two packed micro-batches of random sequences with a prompt and a group advantage."""
    g = torch.Generator().manual_seed(seed)
    mbs = []
    for lens in ((9, 14, 6), (12, 11)):
        seqs = []
        for n in lens:
            ids = torch.randint(3, vocab, (n,), generator=g)
            adv = torch.full((n,), float(n % 3) - 1)
            seqs.append({"input_ids": ids, "prompt_len": 3, "advantages": adv})
            seqs[-1].update(next_token_layout(ids))
        mbs.append(pack_sequences(seqs))
    return mbs


def main_params(optimizer) -> list:
    """``(model param, fp32 main param)`` pairs of megatron's mixed-precision optimizer."""
    opts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [
        (m, f)
        for opt in opts
        for mg, fg in zip(opt.float16_groups, opt.fp32_from_float16_groups)
        for m, f in zip(mg, fg)
    ]


def main() -> None:
    hf_dir, work, out_json = sys.argv[1:4]
    ckpt = Path(work) / "mcore"
    convert_hf_to_mcore(hf_dir, ckpt, dtype="bf16", progress=False)
    mesh = _single_process_mesh()
    eng = MegatronEngine(
        ModelConfig(dtype="bf16", path=hf_dir),
        role="actor",
        mesh=mesh,
        optimizer_cfg=OptimizerConfig(lr=1e-3),
        seed=7,
        use_distributed_optimizer=False,
    )
    load_checkpoint(ckpt, eng.model_chunks(), eng.optimizer, load_optimizer=False, load_rng=False)
    params = [p for c in eng.model_chunks() for p in c.parameters()]
    pairs = main_params(eng.optimizer)
    facts = {
        "n_params": len(params),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "n_main": len(pairs),
        "main_dtypes": sorted({str(f.dtype) for _, f in pairs}),
        "main_hold_loaded": all(torch.equal(f, m.detach().float()) for m, f in pairs),
    }
    before = [p.detach().float().clone() for p in params]
    vocab = eng.vocab_size
    mbs = micro_batches(vocab)
    lps = eng.forward_logprobs(mbs)
    facts["logprob_dtypes"] = sorted({str(lp.dtype) for lp in lps})
    for mb, lp in zip(mbs, lps):  # on-policy behaviour logprobs
        mb["logprobs"] = lp.clone()
    loss_fn, denominator_fn = make_policy_loss(AlgorithmConfig(), prox_from_forward=True)
    seen = {"logprobs": set(), "loss": set()}

    @functools.wraps(loss_fn)  # keeps its attributes (the engine reads loss-mask rows only)
    def recording_loss(logprobs, entropy, mb):
        """The production loss; records the dtypes it gets and returns."""
        numerator, stats = loss_fn(logprobs, entropy, mb)
        seen["logprobs"].add(str(logprobs.dtype))
        seen["loss"].add(str(numerator.dtype))
        return numerator, stats

    # the output layer's gradient written over its logits (ops.logits_read_by_loss_only, as
    # the engine asks it) against a new buffer: the same main gradients, bit for bit
    import areal_mega.ops as ops

    decide = ops.logits_read_by_loss_only
    grads, asked = {}, []
    for name, rule in (("over_logits", None), ("new_buffer", lambda logits: False)):
        ops.logits_read_by_loss_only = rule or (lambda t: asked.append(decide(t)) or asked[-1])
        try:
            eng.forward_backward(mbs, recording_loss, denominator_fn)
        finally:
            ops.logits_read_by_loss_only = decide
        grads[name] = [
            p.main_grad.clone() for p in params if getattr(p, "main_grad", None) is not None
        ]
    facts["grad_in_logits_asked"] = sorted(set(asked))
    facts["grad_in_logits_equal"] = len(grads["new_buffer"]) > 0 and all(
        torch.equal(a, b) for a, b in zip(grads["over_logits"], grads["new_buffer"])
    )
    losses = [eng.train_batch(mbs, recording_loss, denominator_fn)["loss"] for _ in range(2)]
    facts["loss_logprob_dtypes"] = sorted(seen["logprobs"])
    facts["loss_dtypes"] = sorted(seen["loss"])
    facts["losses"] = [float(x) for x in losses]
    facts["grad_buffer_dtypes"] = sorted(
        {str(p.main_grad.dtype) for p in params if getattr(p, "main_grad", None) is not None}
    )
    facts["max_change"] = max(
        float((p.detach().float() - b).abs().max()) for p, b in zip(params, before)
    )
    facts["main_round_to_params"] = all(
        torch.equal(f.to(m.dtype), m.detach()) for m, f in main_params(eng.optimizer)
    )
    Path(out_json).write_text(json.dumps(facts))
    mesh.destroy(process_group=True)


if __name__ == "__main__":
    main()
