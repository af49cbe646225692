"""Single-process conversion jobs for tests/test_convert_*.py (run as a script in a fresh
process: the converters initialise a world-size-1 process group and megatron's CPU patches).

    python -m tests.helpers.convert_worker WORKDIR   -> WORKDIR/results.json
"""

import json
import sys
from pathlib import Path

# name -> (make_tiny_model overrides, convert_hf_to_mcore kwargs)
VARIANTS = {
    "llama_tied_gqa": (
        dict(arch="llama", tie_word_embeddings=True, num_kv_heads=2),
        dict(tp=2, pp=2),
    ),
    "llama_untied_mha": (
        dict(arch="llama", tie_word_embeddings=False, num_kv_heads=4),
        dict(tp=2, pp=2),
    ),
    "qwen2_untied_bias": (dict(arch="qwen2", tie_word_embeddings=False), dict(tp=2, pp=2)),
    "qwen3_tied_qknorm": (dict(arch="qwen3", tie_word_embeddings=True), dict(tp=2, pp=2)),
    "qwen3_moe_untied": (dict(arch="qwen3_moe", tie_word_embeddings=False), dict(tp=2, pp=2, ep=2)),
    "qwen3_moe_tied": (dict(arch="qwen3_moe", tie_word_embeddings=True), dict(tp=2, ep=2)),
    "glm4_moe": (
        dict(
            arch="glm4_moe",
            tie_word_embeddings=False,
            num_layers=4,
            num_experts=8,
            moe_intermediate_size=32,
        ),
        dict(tp=2, pp=2, ep=2),
    ),
    "deepseek_v3": (
        dict(
            arch="deepseek_v3",
            tie_word_embeddings=False,
            num_layers=4,
            num_experts=8,
            moe_intermediate_size=32,
        ),
        dict(tp=2, pp=2, ep=2),
    ),
    "llama_4layers_vpp": (
        dict(arch="llama", tie_word_embeddings=False, num_layers=4),
        dict(tp=2, pp=2, vpp=2),
    ),
    "llama_bf16": (dict(arch="llama", tie_word_embeddings=False), dict(tp=2, pp=2, dtype="bf16")),
}


def load_all(d):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def compare(a, b):
    import torch

    bad = sorted(set(a) ^ set(b))
    for k in set(a) & set(b):
        x, y = a[k], b[k]
        if (
            x.dtype != y.dtype
            or x.shape != y.shape
            or not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
        ):
            bad.append(k)
    return bad


def main(work):
    import torch

    from areal_mega.checkpoint.convert import convert_hf_to_mcore, convert_mcore_to_hf
    from areal_mega.models.tiny import make_tiny_model

    work = Path(work)
    res = {}
    for name, (spec, kw) in VARIANTS.items():
        hf = make_tiny_model(work / name / "hf", **spec)
        r1 = convert_hf_to_mcore(hf, work / name / "mcore", progress=False, **kw)
        r2 = convert_mcore_to_hf(work / name / "mcore", work / name / "hf2", progress=False)
        src, dst = load_all(hf), load_all(work / name / "hf2")
        if kw.get("dtype") == "bf16":
            src = {k: v.to(torch.bfloat16) for k, v in src.items()}
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(work / name / "hf2")
        res[name] = {
            "n_tensors": len(src),
            "mismatches": compare(src, dst),
            "hf2_files": sorted(p.name for p in (work / name / "hf2").iterdir()),
            "transformers_params": sum(p.numel() for p in m.parameters()),
            "to_mcore": {k: v for k, v in r1.items() if k != "path"},
            "to_hf": {k: v for k, v in r2.items() if k not in ("meta",)},
        }
    (work / "results.json").write_text(json.dumps(res, indent=2, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
