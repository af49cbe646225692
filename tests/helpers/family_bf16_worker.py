"""Worker of tests/test_families_bf16.py: one family's tiny HF model in bf16 as the trainer
builds it (one process, gloo): ``convert_hf_to_mcore(dtype="bf16")`` -> ``MegatronEngine``
(``model.dtype=bf16``) -> ``load_checkpoint``; its packed logprobs of three sequences against
transformers' (eager attention) in fp32 and in bf16. Writes the parameter and logprob dtypes
and the largest logprob differences from transformers' fp32 (ours in bf16, transformers in
bf16, ours in fp32 from the same weights) as JSON.

    python -m tests.helpers.family_bf16_worker HF_DIR WORK_DIR OUT_JSON
"""

import json
import sys
from pathlib import Path

import torch

from areal_mega.checkpoint.convert import _single_process_mesh, convert_hf_to_mcore
from areal_mega.checkpoint.dist_ckpt import load_checkpoint
from areal_mega.config import ModelConfig
from areal_mega.engine import MegatronEngine
from areal_mega.scheduler.packing import pack_sequences
from areal_mega.train.batches import next_token_layout

LENGTHS = (9, 14, 21)


def hf_logprobs(hf_dir: str, seqs: list, dtype: torch.dtype) -> list:
    """transformers' next-token logprobs of each sequence (fp32 log-softmax of its logits)."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=dtype, attn_implementation="eager"
    ).eval()
    out = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(m(input_ids=s[None]).logits[0].float(), -1)
            out.append(lp[:-1].gather(1, s[1:, None])[:, 0])
    return out


def engine_logprobs(hf_dir: str, ckpt: Path, dtype: str, seqs: list, mesh) -> tuple:
    """Our engine's packed logprobs of ``seqs`` per sequence, and its parameter and logprob
    dtypes."""
    eng = MegatronEngine(ModelConfig(dtype=dtype, path=hf_dir), role="ref", mesh=mesh, seed=5)
    load_checkpoint(ckpt, eng.model_chunks(), load_optimizer=False, load_rng=False)
    mb = pack_sequences([next_token_layout(s) for s in seqs])
    got = eng.forward_logprobs([mb])[0]
    cu = [int(x) for x in mb["cu_seqlens"]]
    per_seq = [got[cu[b] : cu[b] + len(s) - 1] for b, s in enumerate(seqs)]
    params = {str(p.dtype) for c in eng.model_chunks() for p in c.parameters()}
    return per_seq, sorted(params), str(got.dtype)


def max_diff(a: list, b: list) -> float:
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(a, b))


def main() -> None:
    hf_dir, work, out_json = sys.argv[1:4]
    vocab = json.loads((Path(hf_dir) / "config.json").read_text())
    vocab = (vocab.get("text_config") or vocab)["vocab_size"]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]
    mesh = _single_process_mesh()
    facts = {}
    ref = hf_logprobs(hf_dir, seqs, torch.float32)
    for dtype in ("bf16", "fp32"):
        ckpt = Path(work) / f"mcore_{dtype}"
        convert_hf_to_mcore(hf_dir, ckpt, dtype=dtype, progress=False)
        ours, params, lp_dtype = engine_logprobs(hf_dir, ckpt, dtype, seqs, mesh)
        facts[f"{dtype}.param_dtypes"] = params
        facts[f"{dtype}.logprob_dtype"] = lp_dtype
        facts[f"{dtype}.vs_hf_fp32"] = max_diff(ours, ref)
    facts["hf_bf16.vs_hf_fp32"] = max_diff(hf_logprobs(hf_dir, seqs, torch.bfloat16), ref)
    Path(out_json).write_text(json.dumps(facts, indent=2))


if __name__ == "__main__":
    main()
