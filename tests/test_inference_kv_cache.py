"""The rollout engine's KV-cache batches: rows that join, decode and leave must get the logits
of a plain full-sequence forward of each row alone."""

import pytest
import torch

from areal_mega.inference.kv_cache import HFCacheBatch, StaticKVBatch, make_kv_batch
from areal_mega.models.tiny import make_tiny_model

#: mistral: an explicit head_dim and a sliding window shorter than most rows; gemma3_text:
#: the same window on its sliding layers only (transformers' cache, HFCacheBatch); qwen3_next,
#: qwen3_5_text: a gated delta-net layer (a recurrent state per row, never padded) before a
#: full-attention one; gemma4_text: no key/value-shared layers (transformers 5.12's
#: DynamicCache(config=...) then has no layers of its own: HFCacheBatch adds them)
EXTRA = {
    "mistral": dict(head_dim=24, sliding_window=6),
    "gemma3_text": dict(head_dim=24, sliding_window=6, rope_theta=1e6, query_pre_attn_scalar=32),
    "qwen3_next": dict(head_dim=16),
    "qwen3_5_text": dict(head_dim=16),
    "gemma4_text": dict(head_dim=16, sliding_window=6),
}


def _model(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(
        tmp_path / arch,
        arch=arch,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        seed=3,
        **EXTRA.get(arch, {}),
    )
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _reference(model, seq):
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0, -1].float()


def _join_decode_leave(model, batch, atol=2e-5, rtol=1e-4):
    """Rows join (prompts of different lengths), decode, leave and join again; every row's
    logits must be a full forward's of that row alone."""
    g = torch.Generator().manual_seed(0)
    seqs: list = []

    def check(logits):
        assert logits.shape[0] == len(seqs) == batch.rows
        for row, seq in zip(logits, seqs):
            torch.testing.assert_close(row, _reference(model, seq), atol=atol, rtol=rtol)

    def join(n, length, keep):
        ids = torch.randint(3, 90, (n, length), generator=g)
        with torch.no_grad():
            logits, kv = batch.prefill(ids)
        for row, seq in zip(logits, ids.tolist()):
            torch.testing.assert_close(row, _reference(model, seq), atol=atol, rtol=rtol)
        batch.append(kv, keep)
        seqs.extend(ids[i].tolist() for i in keep)

    def step(times):
        for _ in range(times):
            toks = torch.randint(3, 90, (len(seqs),), generator=g).tolist()
            for s, t in zip(seqs, toks):
                s.append(t)
            with torch.no_grad():
                check(batch.decode(toks))

    join(2, 5, [0, 1])
    step(3)
    join(3, 9, [0, 2])  # a longer prompt joins rows already decoding
    step(2)
    keep = [3, 0, 2]  # rows leave (and change order)
    batch.select(keep)
    seqs[:] = [seqs[i] for i in keep]
    step(2)
    join(1, 70, [0])  # past the first cache capacity (64 columns)
    step(2)
    batch.select([])
    assert batch.rows == 0
    seqs.clear()
    join(2, 4, [1])  # an emptied batch takes new rows again
    step(1)


@pytest.mark.parametrize(
    "arch,kind",
    [
        ("llama", StaticKVBatch),
        ("qwen2", StaticKVBatch),
        ("qwen3_moe", StaticKVBatch),
        ("mistral", StaticKVBatch),
        ("llama", HFCacheBatch),
        ("gemma3_text", HFCacheBatch),
        ("qwen3_next", HFCacheBatch),
        ("qwen3_5_text", HFCacheBatch),
        ("gemma4_text", HFCacheBatch),
    ],
)
def test_join_decode_leave_match_full_forward(tmp_path, arch, kind):
    model = _model(tmp_path, arch)
    if kind is StaticKVBatch or arch in (
        "gemma3_text",
        "qwen3_next",
        "qwen3_5_text",
        "gemma4_text",
    ):
        assert isinstance(make_kv_batch(model), kind)
    _join_decode_leave(model, kind(model))


def test_bf16_model_decodes_over_an_fp32_cache_where_the_kernel_is_built(tmp_path):
    """A bf16 model's keys and values sit in an fp32 cache (exactly their values) that the
    C++ decode attention reads; rows that join, decode, leave and rejoin get a bf16 full
    forward's logits, and the prefix cache's payload comes back in bf16."""
    from areal_mega.ops import decode as decode_ops

    model = _model(tmp_path, "llama").to(torch.bfloat16)
    batch = StaticKVBatch(model)
    _join_decode_leave(model, batch, atol=6e-2, rtol=5e-2)
    with torch.no_grad():
        _, kv = batch.prefill(torch.tensor([[5, 6, 7]]))
    batch.append(kv, [0])
    want = torch.float32 if decode_ops.panel_kernels() is not None else torch.bfloat16
    assert batch.k[0].dtype == want
    assert batch.payload_of_row(batch.rows - 1, 0, 3).dtype == torch.bfloat16
    assert torch.equal(batch.payload_of_row(batch.rows - 1, 0, 3)[0, 0], kv[0][0][0].bfloat16())


def _tiny_glm_moe_dsa(indexer_types):
    """A tiny GLM-MoE-DSA (MLA attention with a DeepSeek-sparse-attention indexer, MoE MLPs).
    Its indexer keeps the top ``index_topk`` keys by a sum of ReLU'd head scores: with few
    heads many keys tie at 0 and the top-k then depends on the key count, so even
    transformers' own cached decode leaves its full forward; 8 heads and a top-k (4) below
    most row lengths avoid that."""
    from transformers import AutoModelForCausalLM, GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_topk=4,
        index_head_dim=16,
        index_n_heads=8,
        indexer_types=list(indexer_types),
        mlp_layer_types=["dense", "sparse", "sparse"],
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


#: "shared": the middle layer reuses the first layer's top-k and keeps no indexer keys
@pytest.mark.parametrize(
    "indexer_types", [("full", "full", "full"), ("full", "shared", "full")], ids=["full", "shared"]
)
def test_glm_moe_dsa_join_decode_leave_match_full_forward(indexer_types):
    """The DSA indexer's key cache is kept, left-padded, selected and restored with the
    keys / values (without it a decode step leaves the full forward by ~0.1-0.4)."""
    model = _tiny_glm_moe_dsa(indexer_types)
    assert isinstance(make_kv_batch(model), HFCacheBatch)
    # the comparison means something: transformers' own cache decodes like the full forward
    g = torch.Generator().manual_seed(1)
    for prompt_len in (3, 9, 70):
        seq = torch.randint(3, 90, (1, prompt_len + 6), generator=g)
        with torch.no_grad():
            out = model(input_ids=seq[:, :prompt_len], use_cache=True)
            for t in range(prompt_len, seq.shape[1]):
                cache = out.past_key_values
                out = model(input_ids=seq[:, t : t + 1], past_key_values=cache, use_cache=True)
                ref = _reference(model, seq[0, : t + 1].tolist())
                torch.testing.assert_close(out.logits[0, -1], ref, atol=2e-5, rtol=1e-4)
    _join_decode_leave(model, HFCacheBatch(model))
    # a row with fewer keys than index_topk beside a longer one: its top-k takes padded keys too
    batch, seqs = HFCacheBatch(model), []
    for length in (10, 2):
        ids = torch.randint(3, 90, (1, length), generator=g)
        with torch.no_grad():
            batch.append(batch.prefill(ids)[1], [0])
        seqs.append(ids[0].tolist())
    for _ in range(3):
        toks = torch.randint(3, 90, (2,), generator=g).tolist()
        with torch.no_grad():
            logits = batch.decode(toks)
        for row, seq, tok in zip(logits, seqs, toks):
            seq.append(tok)
            torch.testing.assert_close(row, _reference(model, seq), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("prefix_len,suffix_len", [(3, 1), (3, 5), (10, 4)])
def test_mistral_window_prefill_after_a_cached_prefix(tmp_path, prefix_len, suffix_len):
    """A prompt continuing a cached prefix (the prefix cache's path) gets the logits of a full
    forward, with the sliding window (6) inside the prefix, across its end, or not reached."""
    model = _model(tmp_path, "mistral")
    batch = StaticKVBatch(model)
    assert batch.window == 6
    g = torch.Generator().manual_seed(prefix_len)
    ids = torch.randint(3, 90, (1, prefix_len + suffix_len), generator=g)
    with torch.no_grad():
        _, kv = batch.prefill(ids[:, :prefix_len])
        payload = StaticKVBatch.payload_of_prefill(kv, 0, 0, prefix_len)
        logits, _ = batch.prefill(ids[:, prefix_len:], prefix=StaticKVBatch.split_payload(payload))
    torch.testing.assert_close(logits[0], _reference(model, ids[0].tolist()), atol=2e-5, rtol=1e-4)
