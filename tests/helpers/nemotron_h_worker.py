"""Nemotron-H's HybridModel built at one rank on the CPU (areal_mega/models/nemotron_h.py: the
bridge's provider fields, the local hybrid stack spec, the compat patches) against transformers.

    python -m tests.helpers.nemotron_h_worker
        -> prints NEMOTRON_H {"logits": rel. difference, "grads": {param: rel. difference}}

A tiny transformers Nemotron-H (pattern ``M*M-``: Mamba, attention, Mamba, MLP) with every
weight random (norm gains around 1, ``A_log`` in [-1, 1]); its weights are loaded by
Megatron-Bridge's own loader (the reference mapping; it names the embedding
``backbone.embeddings.weight`` where transformers 5.12.1 saves ``backbone.embedding.weight``,
so that one tensor is copied here). Three sequences packed as the engine packs them
(``packed_seq_kwargs``), megatron's scan chunk (16) below their lengths; transformers runs each
alone as one chunk (its torch path is wrong past the first chunk), ``time_step_min`` 0 (its
torch path clamps dt there, megatron does not).
"""

import json
import tempfile
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402

LENGTHS = (40, 3, 29)
PATTERN = "M*M-"


def tiny_config():
    """The tiny transformers ``NemotronHConfig`` (pattern :data:`PATTERN`) of this worker's
    model; tests/test_nemotron_h.py builds its refusal checks on it too."""
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

    return NemotronHConfig(
        vocab_size=40,
        hidden_size=32,
        hybrid_override_pattern=PATTERN,
        num_hidden_layers=len(PATTERN),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        mamba_num_heads=4,
        mamba_head_dim=8,
        n_groups=2,
        ssm_state_size=8,
        conv_kernel=4,
        chunk_size=16,
        use_mamba_kernels=False,
        tie_word_embeddings=False,
        layer_norm_epsilon=1e-5,
        max_position_embeddings=256,
    )


def _hf_model():
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHForCausalLM

    torch.manual_seed(0)
    hf = NemotronHForCausalLM(tiny_config()).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight") or n.endswith("norm_f.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif "A_log" in n:
                p.copy_(torch.rand_like(p) * 2 - 1)
            else:
                p.copy_(torch.randn_like(p) * 0.15)
    for m in hf.modules():
        if hasattr(m, "time_step_min"):
            m.time_step_min = 0.0  # (see the module docstring; the config's must be > 0)
    return hf


def main():
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from areal_mega.compat import megatron_cpu

    megatron_cpu.apply(force=True)
    from areal_mega.engine.packed_params import packed_seq_kwargs
    from areal_mega.models.bridge_provider import _import_auto_bridge
    from areal_mega.models.nemotron_h import nemotron_h_config_fields, nemotron_h_model
    from areal_mega.parallel.mesh import init_distributed

    init_distributed()
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    hf = _hf_model()
    d = tempfile.mkdtemp()
    hf.save_pretrained(d)
    hf_dict = json.loads(open(f"{d}/config.json").read())
    fields, model_kw = nemotron_h_config_fields(hf_dict)
    config = TransformerConfig(
        **fields,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",
    )
    model = nemotron_h_model(
        config,
        dict(model_kw, chunk_size=16),
        40,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    ).float()
    bridge = _import_auto_bridge().from_hf_pretrained(d)
    bridge.load_hf_weights([model])
    with torch.no_grad():
        model.embedding.word_embeddings.weight.copy_(hf.model.embeddings.weight)

    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    total = int(cu[-1])
    ids = torch.randint(0, 40, (1, total), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    packed = PackedSeqParams(**packed_seq_kwargs(cu, None, total))
    got = model(ids, pos, None, packed_seq_params=packed)[..., :40]
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for m in hf.modules():
        if hasattr(m, "chunk_size"):
            m.chunk_size = max(LENGTHS)  # one chunk per sequence (see the module docstring)
    want = torch.cat([hf(ids[:, s:e], use_cache=False).logits for s, e in bounds], 1)
    got = got.reshape(want.shape)
    w = torch.randn(want.shape, generator=torch.Generator().manual_seed(2))
    (got * w).sum().backward()
    (want * w).sum().backward()
    mine = dict(model.named_parameters())
    theirs = dict(hf.named_parameters())
    pairs = {
        "decoder.layers.0.mixer.in_proj.weight": "model.layers.0.mixer.in_proj.weight",
        "decoder.layers.0.mixer.A_log": "model.layers.0.mixer.A_log",
        "decoder.layers.0.mixer.dt_bias": "model.layers.0.mixer.dt_bias",
        "decoder.layers.0.mixer.conv1d_weight": "model.layers.0.mixer.conv1d.weight",
        "decoder.layers.0.mixer.norm.weight": "model.layers.0.mixer.norm.weight",
        "decoder.layers.0.norm.weight": "model.layers.0.norm.weight",
        "decoder.layers.1.self_attention.linear_proj.weight": "model.layers.1.mixer.o_proj.weight",
        "decoder.layers.3.mlp.linear_fc1.weight": "model.layers.3.mixer.up_proj.weight",
        "decoder.final_norm.weight": "model.norm_f.weight",
        "embedding.word_embeddings.weight": "model.embeddings.weight",
    }

    def rel(a, b):
        return float((a.reshape(b.shape) - b).abs().max()) / float(b.abs().max())

    res = {
        "logits": rel(got.detach(), want.detach()),
        "grads": {a: rel(mine[a].grad, theirs[b].grad) for a, b in pairs.items()},
    }
    print("NEMOTRON_H " + json.dumps(res))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
