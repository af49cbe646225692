"""Layout equality of the DeepSeek-style MoE families, run by tests/test_moe_families.py in 2
gloo processes (the machinery of tests/helpers/engine_worker.py: a single-rank reference, then each
layout holding the reference weights).

    python -m tests.helpers.moe_family_worker <scenario> <rank> <world> <port> <out_dir>

(scenario: a family, or ``both``, as tests/test_moe_families.py runs them)

``glm4_moe``: 4 layers (layer 0 dense), 8 experts in 2 groups (top-1 group, top-2 experts),
a shared expert, non-zero expert biases, partial rotary, QKV bias and QK norms; the policy
loss; layouts EP2 (inside DP2), TP2 + sequence parallelism, PP2. ``deepseek_v3``: the same
router and layouts with multi-latent attention (q and kv LoRA ranks 32, rope dims 8 of 24).
"""

import os
import sys

import torch

from tests.helpers import engine_worker as ew

GLM4_MOE = dict(
    ew.DENSE,
    model_type="glm4_moe",
    num_hidden_layers=4,
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
)

DEEPSEEK_V3 = dict(
    GLM4_MOE,
    model_type="deepseek_v3",
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_interleave=True,
    attention_bias=False,
    head_dim=8,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
)


def random_expert_bias(model):
    """Non-zero expert biases (a fixed function of the layer), as a real checkpoint has."""
    for name, buf in model.named_buffers():
        if name.endswith("router.expert_bias"):
            layer = int(name.split(".")[2])
            g = torch.Generator().manual_seed(100 + layer)
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.02)


def scenario_glm4_moe(res, out_dir, hf=GLM4_MOE):
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    mbs = ew.make_mbs(8, [[9, 14, 5], [20, 3], [6, 6, 6, 4], [17]])
    ew.set_mesh(dict(dp=world))
    ref = ew.reference(hf, mbs, seed=31, loss=ew.POLICY, prepare=random_expert_bias)
    res["expert_bias_max"] = max(
        float(v.abs().max()) for k, v in ref["state"].items() if k.endswith("expert_bias")
    )
    ew.set_mesh(dict(dp=world, ep=world))
    ew.check_layout(
        res, "ep2", hf, ref, mbs, my_mbs=mbs[rank::world], my_ref_lps=ref["lps"][rank::world]
    )
    ew.set_mesh(dict(tp=world), sp=True)
    ew.check_layout(res, "tp2sp", hf, ref, mbs)
    if hf["model_type"] == "deepseek_v3":  # upstream MLA without our CPU patch: grads differ
        from megatron.core.transformer.multi_latent_attention import MLASelfAttention as mla

        patched = mla.get_query_key_value_tensors
        mla.get_query_key_value_tensors = patched.__wrapped_original__
        try:
            ew.check_layout(res, "tp2sp_unpatched", hf, ref, mbs)
        finally:
            mla.get_query_key_value_tensors = patched
    ew.set_mesh(dict(pp=world))
    ew.check_layout(res, "pp2", hf, ref, mbs)


def scenario_both(res, out_dir):
    """Both families one after the other (one pair of processes): ``res[family]`` holds each
    family's checks."""
    for family, hf in (("glm4_moe", GLM4_MOE), ("deepseek_v3", DEEPSEEK_V3)):
        res[family] = {}
        scenario_glm4_moe(res[family], out_dir, hf=hf)


if __name__ == "__main__":
    sys.exit(
        ew.run_scenario(
            {
                "glm4_moe": scenario_glm4_moe,
                "deepseek_v3": lambda res, out: scenario_glm4_moe(res, out, hf=DEEPSEEK_V3),
                "both": scenario_both,
            }
        )
    )
