"""One-process (gloo, world 1) check of the MoE load-balancing loss gradient, run by
tests/test_moe_aux.py:

    python -m tests.helpers.moe_aux_worker <out.json>

Two actors with the same weights, router_aux_loss_coef = COEF and 0, run one forward_backward
on the same micro-batches of different lengths. The difference of their router-weight
gradients is the aux-loss gradient; it is compared with an independent torch computation of
COEF · Σ_mb aux_mb · T_mb / Σ_mb T_mb from the router inputs recorded during the forward.
"""

import json
import sys
import traceback

import torch

COEF = 0.01
VOCAB = 200
MOE = dict(
    model_type="qwen3_moe",
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    mlp_only_layers=[0],
)
ROUTER = "decoder.layers.1.mlp.router"


def loss_fn(lp, ent, mb):
    m = mb["loss_mask"].to(lp.device).float()
    return -(lp * m * mb["adv"].to(lp.device)).sum(), {"token_count": m.sum().detach()}


def reference_aux_grad(weight, inputs, topk, n_experts):
    """d/dW of COEF · Σ_mb aux_mb · T_mb / N, aux_mb = E · Σ_i f_i · P_i (Switch loss)."""
    w = weight.detach().clone().double().requires_grad_(True)
    n_total = sum(x.shape[0] for x in inputs)
    total, values = 0.0, []
    for x in inputs:
        x = x.double()
        t = x.shape[0]
        scores = torch.softmax(x @ w.t(), dim=-1)
        top = torch.topk(scores.detach(), topk, dim=-1).indices
        counts = torch.zeros(n_experts, dtype=torch.float64).scatter_add_(
            0, top.reshape(-1), torch.ones(top.numel(), dtype=torch.float64)
        )
        f = counts / (t * topk)
        p = scores.mean(dim=0)
        aux = n_experts * (f * p).sum()
        values.append(float(aux))
        total = total + COEF * aux * t / n_total
    total.backward()
    return w.grad.float(), values


def main():
    out_path = sys.argv[1]
    res = {}
    try:
        from areal_mega.common.net import free_port
        from areal_mega.config import ModelConfig, OptimizerConfig
        from areal_mega.engine import MegatronEngine
        from areal_mega.parallel.allocation import ParallelDims
        from areal_mega.parallel.mesh import ParallelMesh
        from areal_mega.scheduler.packing import pack_sequences
        from areal_mega.train.batches import next_token_layout

        mesh = ParallelMesh.create(
            ParallelDims(),
            rank=0,
            world_size=1,
            timeout_s=120,
            init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        engines = {}
        for coef in (COEF, 0.0):
            engines[coef] = MegatronEngine(
                ModelConfig(dtype="fp32"),
                hf_config=dict(MOE, router_aux_loss_coef=coef),
                role="actor",
                mesh=mesh,
                optimizer_cfg=OptimizerConfig(lr=1e-3, clip_grad=0.0),
                seed=3,
            )
        a, b = engines[COEF], engines[0.0]
        for (n1, p1), (n2, p2) in zip(
            a.model[0].module.named_parameters(), b.model[0].module.named_parameters()
        ):
            assert n1 == n2 and torch.equal(p1, p2), n1
        res["moe_aux_loss_coeff"] = float(a.config.moe_aux_loss_coeff)
        g = torch.Generator().manual_seed(0)
        mbs = []
        for lens, pad in (([9, 14, 5], 8), ([20, 3], 1), ([6, 6, 6, 4], 16)):
            seqs = [
                {
                    "input_ids": torch.randint(0, VOCAB, (n,), generator=g),
                    "prompt_len": max(1, n // 3),
                    "adv": torch.randn(n, generator=g),
                }
                for n in lens
            ]
            seqs = [{**s, **next_token_layout(s["input_ids"])} for s in seqs]  # + labels
            mbs.append(pack_sequences(seqs, pad_to_multiple=pad))
        inputs = []
        router = dict(a.model[0].module.named_modules())[ROUTER]
        hook = router.register_forward_hook(
            lambda mod, args, out: inputs.append(args[0].detach().reshape(-1, args[0].shape[-1]))
        )
        stats_a = a.forward_backward(mbs, loss_fn)
        hook.remove()
        stats_b = b.forward_backward(mbs, loss_fn)
        wa = dict(a.model[0].module.named_parameters())[ROUTER + ".weight"]
        wb = dict(b.model[0].module.named_parameters())[ROUTER + ".weight"]
        got = wa.main_grad.float() - wb.main_grad.float()
        want, values = reference_aux_grad(wa, inputs, topk=2, n_experts=4)
        res["n_router_calls"] = len(inputs)
        res["tokens"] = [int(x.shape[0]) for x in inputs]
        res["grad_max_abs_diff"] = (got - want).abs().max().item()
        res["grad_ref_max_abs"] = want.abs().max().item()
        res["grad_got_max_abs"] = got.abs().max().item()
        res["loss_a"], res["loss_b"] = stats_a["loss"], stats_b["loss"]
        res["stats_keys"] = sorted(stats_a)
        if "moe_aux_loss_tokens" in stats_a:
            res["aux_logged"] = stats_a["moe_aux_loss_sum"] / stats_a["moe_aux_loss_tokens"]
        res["aux_ref_mean"] = sum(values) / len(values)
        res["coeff_restored"] = float(a.config.moe_aux_loss_coeff)
        # other parameters: the main loss gradient is the same with and without the aux loss
        # where the aux loss cannot reach (the output layer and the final norm)
        pa = dict(a.model[0].module.named_parameters())
        pb = dict(b.model[0].module.named_parameters())
        res["output_layer_grad_diff"] = (
            (pa["output_layer.weight"].main_grad - pb["output_layer.weight"].main_grad)
            .abs()
            .max()
            .item()
        )
    except Exception:
        res["error"] = traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
