"""Multi-rank engine equality checks, run by tests/test_engine_multirank.py in 2 gloo processes.

    python -m tests.helpers.engine_worker <scenario> <rank> <world> <port> <out_dir>

Each scenario builds a single-rank reference (TP1/PP1/EP1 model, plain autograd, no pipeline
schedule) in every process from one seed, then re-initialises the mesh in the layouts under
test, copies the reference weights into each layout's shards and records the max abs
difference of per-token logprobs and gradients. Rank r writes ``<out_dir>/<scenario>.<r>.json``
({check: max_diff}). Everything here is real megatron-core over gloo (NCCL for ``gpu_*``).

The losses are the production ones: the decoupled PPO loss of :func:`make_policy_loss` (its
``prox_logprobs`` the reference model's own logprobs, ``logprobs`` / ``ref_logprobs`` those
plus a little noise, ratios inside the clip range) and the SFT loss."""

import gc
import json
import os
import re
import sys
import traceback

import torch

from areal_mega.config import ModelConfig, OptimizerConfig
from areal_mega.scheduler.packing import pack_sequences
from areal_mega.train.batches import next_token_layout
from tests.helpers import group_batches

VOCAB = 200  # padded to 256: the padded ids must be excluded from the softmax
DENSE = dict(
    model_type="qwen3",
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
)
TIED = dict(
    DENSE,
    model_type="llama",
    tie_word_embeddings=True,
    head_dim=None,
    rope_theta=50000.0,
    rms_norm_eps=1e-5,
)
BIAS = dict(DENSE, model_type="qwen2", head_dim=None)
#: a vocabulary table of main_grad.MIN_SPLIT elements (65,536 × 64): the output layer's weight
#: gradient is added into its main gradient in the backward (areal_mega/compat/main_grad.py);
#: the batches' ids stay below VOCAB
BIG_VOCAB = 65536
MOE = dict(
    DENSE,
    model_type="qwen3_moe",
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
)
TEMP = 0.7
#: the policy loss of the dense layouts, and a sequence-level one (GSPO ratio, mean of sequence
#: means, geometric importance weight) for the pipeline layout and context parallelism
POLICY = dict(kl_coef=0.05, entropy_coef=0.01)
GSPO = dict(POLICY, ratio_level="sequence", loss_agg="seq_mean", imp_weight_level="geometric")


def losses(kind, **kw):
    """``(loss_fn, denominator_fn)`` of the production losses: ``"sft"`` or a dict of
    :class:`~areal_mega.config.AlgorithmConfig` fields for :func:`make_policy_loss`(``**kw``)."""
    if kind == "sft":
        from areal_mega.engine import default_denominator
        from areal_mega.train.sft import sft_loss

        return sft_loss, default_denominator
    import dataclasses

    from areal_mega.algo import make_policy_loss
    from areal_mega.config import AlgorithmConfig

    return make_policy_loss(dataclasses.replace(AlgorithmConfig(), **kind), **kw)


def attach_policy_inputs(mb, lp, seed):
    """The policy loss's inputs for one micro-batch whose current logprobs are ``lp``."""
    g = torch.Generator().manual_seed(seed)
    lp = lp.detach().float().cpu()
    mb["prox_logprobs"] = lp.clone()
    mb["logprobs"] = lp + (torch.rand(lp.shape, generator=g) - 0.5) * 0.3
    mb["ref_logprobs"] = lp + (torch.rand(lp.shape, generator=g) - 0.5) * 0.3


# ----------------------------------------------------------------------------- data
def make_mbs(seed, lens_per_mb, pad=2, cp=1):
    g = torch.Generator().manual_seed(seed)
    mbs = []
    for lens in lens_per_mb:
        seqs = [
            {
                "input_ids": torch.randint(0, VOCAB, (n,), generator=g),
                "prompt_len": max(1, n // 3),
                "advantages": torch.randn(1, generator=g).expand(n).clone(),
            }
            for n in lens
        ]
        seqs = [{**s, **next_token_layout(s["input_ids"])} for s in seqs]  # + labels
        mbs.append(pack_sequences(seqs, pad_to_multiple=pad, cp_size=cp))
    return mbs


# ----------------------------------------------------------------------------- reference
def _reference_masking(eng, hf, mb) -> tuple:
    """The reference forward's ``(attention_mask, packed_seq_params)`` for one micro-batch: the
    block-causal mask; with it, for a model with linear-attention layers (Qwen3-Next's gated
    delta-net: a recurrence over the packed row, which no attention mask confines to a
    sequence) or with DeepSeek sparse attention (megatron's indexer reads the sequences from
    the packed parameters), the packed slots as the engine builds them; for a Mamba hybrid
    (Nemotron-H, Falcon-H1), whose Mamba layers keep packed sequences apart only through
    ``PackedSeqParams.seq_idx``, the packed parameters from the segment lengths and no mask."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from areal_mega.engine.packed import block_causal_mask
    from areal_mega.engine.packed_params import packed_seq_kwargs

    seg = mb["segment_ids"].long()
    if eng.arch.has_mamba:
        lens = torch.unique_consecutive(seg, return_counts=True)[1]
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        return None, PackedSeqParams(**packed_seq_kwargs(cu, None, int(cu[-1])))
    if "linear_attention" in (hf.get("layer_types") or ()) or eng.arch.dsa_indexer is not None:
        kw = packed_seq_kwargs(mb["cu_seqlens"], mb.get("cu_seqlens_padded"), seg.numel())
        return block_causal_mask(seg), PackedSeqParams(**kw)
    return block_causal_mask(seg), None


def reference(hf, mbs, seed, loss="sft", prepare=None):
    """TP1/PP1 model on the current (d=world) mesh: weights, logprobs, grads, plain autograd,
    the production ``loss`` (see :func:`losses`) called on each whole micro-batch. A policy
    loss's inputs are attached to ``mbs`` from the logprobs computed here. ``prepare(model)``
    may set non-trained state first (e.g. routers' expert biases)."""
    from areal_mega.engine import MegatronEngine
    from areal_mega.engine.packed import micro_batch_labels
    from areal_mega.ops import packed_logprobs

    eng = MegatronEngine(
        ModelConfig(dtype="fp32"), hf_config=hf, role="ref", mesh=MESH[0], seed=seed
    )
    model = eng.model[0]
    model.requires_grad_(True)
    if prepare is not None:
        prepare(model)
    state = {
        k: v.detach().clone()
        for k, v in model.state_dict().items()
        if not k.endswith("_extra_state")
    }
    loss_fn, den_fn = losses(loss)
    denom = float(sum(den_fn(mb) for mb in mbs))
    lps, total = [], 0.0
    for i, mb in enumerate(mbs):
        ids = mb["input_ids"].long()
        labels = micro_batch_labels(mb, ids.numel())
        valid = labels >= 0
        mask, packed = _reference_masking(eng, hf, mb)
        logits = model(ids[None], mb["position_ids"][None], mask, packed_seq_params=packed)[0]
        logits = logits.masked_fill(torch.arange(logits.shape[-1]) >= hf["vocab_size"], -1e9)
        lp, ent = packed_logprobs(logits, labels, temperature=TEMP, return_entropy=True)
        lp = torch.where(valid, lp, torch.zeros_like(lp))
        ent = torch.where(valid, ent, torch.zeros_like(ent))
        if loss != "sft":
            attach_policy_inputs(mb, lp, seed * 100 + i)
        num, _ = loss_fn(lp, ent, mb)
        (num / denom).backward()
        total += float(num) / denom
        lps.append(lp.detach())
    # a parameter the loss does not reach (a DSA indexer's: detached inputs, a top-k) has no
    # .grad; the layouts' main_grad of it stays zero
    grads = {
        n: torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
        for n, p in model.named_parameters()
    }
    return {
        "state": state,
        "lps": lps,
        "grads": grads,
        "grad_norm": float(sum(float((g.double() ** 2).sum()) for g in grads.values()) ** 0.5),
        "loss": total,
        "kind": loss,
        "n_tokens": denom,
    }


# ----------------------------------------------------------------------------- shard mapping
_LAYER = re.compile(r"decoder\.layers\.(\d+)\.")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def global_name(name, chunk, mesh, hf):
    """Reference (TP1/PP1/EP1) name of a local parameter name."""
    name = name.replace("module.", "", 1) if name.startswith("module.") else name
    m = _LAYER.search(name)
    if m:
        g = chunk.decoder.layers[int(m.group(1))].layer_number - 1
        name = name[: m.start()] + f"decoder.layers.{g}." + name[m.end() :]
    m = _EXPERT.search(name)
    if m:
        per = hf["num_experts"] // mesh.dims.ep
        from megatron.core import parallel_state as ps

        g = int(m.group(1)) + ps.get_expert_model_parallel_rank() * per
        name = name[: m.start()] + f"local_experts.{g}." + name[m.end() :]
    if name == "output_layer.weight" and hf.get("tie_word_embeddings"):
        name = "embedding.word_embeddings.weight"
    return name


def shard_of(full, param, name, mesh, gated=True, hf=None):
    """This rank's TP shard of a reference tensor (``gated``: the model's MLPs are gated;
    ``hf``: the config, for the gated delta-net's tensors split section by section). A routed
    expert's (megatron marks them ``allreduce=False``) splits over the expert TP group."""
    tp, r = mesh.dims.tp, mesh.tp_rank
    if not getattr(param, "allreduce", True):
        from megatron.core import parallel_state as ps

        tp, r = mesh.dims.expert_tp, ps.get_expert_tensor_parallel_rank()
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    dim = param.partition_dim
    sizes = getattr(param, "partition_sizes", None)  # per-rank rows of each section (Mamba)
    if sizes is not None:
        sections = full.split([n * tp for n in sizes], dim=0)
        return torch.cat([sec.chunk(tp, dim=0)[r] for sec in sections], dim=0)
    if gated and name.endswith("linear_fc1.weight"):  # [gate; up] split separately
        two = full.view(2, full.shape[0] // 2, -1)
        return two.chunk(tp, dim=1)[r].reshape(-1, full.shape[1])
    sections = gdn_sections(hf, name)
    if sections is not None:
        return torch.cat([x.chunk(tp, dim=0)[r] for x in full.split(list(sections))])
    return full.chunk(tp, dim=dim)[r]


def gdn_sections(hf, name):
    """The sections of a gated delta-net tensor megatron splits across TP one by one
    (:func:`areal_mega.checkpoint.hf_mapping_gdn.tp_sections`); None for other tensors."""
    if hf is None or "linear_attention" not in (hf.get("layer_types") or ()):
        return None
    from areal_mega.checkpoint.hf_mapping import parse_mcore_name
    from areal_mega.checkpoint.hf_mapping_gdn import tp_sections
    from areal_mega.models.builder import parse_hf_config

    return tp_sections(parse_hf_config(hf), parse_mcore_name(name)[2])


def load_reference(eng, ref, hf):
    for chunk in eng.model:
        inner = chunk.module if hasattr(chunk, "module") else chunk
        for n, p in inner.named_parameters():
            full = ref["state"][global_name(n, inner, eng.mesh, hf)]
            p.data.copy_(shard_of(full, p, n, eng.mesh, inner.config.gated_linear_unit, hf))
        for n, b in inner.named_buffers():  # routers' expert biases (replicated)
            if n.endswith("router.expert_bias"):
                b.copy_(ref["state"][global_name(n, inner, eng.mesh, hf)])


def compare_grads(eng, ref, hf):
    """(max abs difference, ‖Δ‖₂ / ‖reference‖₂ over all of this rank's parameters)."""
    worst, d2, r2 = 0.0, 0.0, 0.0
    for chunk in eng.model:
        inner = chunk.module
        for n, p in inner.named_parameters():
            g = p.main_grad if getattr(p, "main_grad", None) is not None else p.grad
            full = ref["grads"][global_name(n, inner, eng.mesh, hf)]
            want = shard_of(full, p, n, eng.mesh, inner.config.gated_linear_unit, hf)
            diff = g.float() - want.float().to(g.device)
            worst = max(worst, diff.abs().max().item())
            d2 += float((diff * diff).sum())
            r2 += float((want.float() * want.float()).sum())
    return worst, (d2 / max(r2, 1e-30)) ** 0.5


def compare_lps(got, want):
    return max((a.float().cpu() - b.float().cpu()).abs().max().item() for a, b in zip(got, want))


# ----------------------------------------------------------------------------- scenarios
MESH = [None]


def set_mesh(spec, sp=False, vpp=None):
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh

    if MESH[0] is not None:
        MESH[0].destroy()
        # the last layout's engines are garbage in reference cycles, holding its process
        # groups (each gloo group two busy threads) until a full collection: a worker that
        # runs layout after layout would otherwise pile up thousands of them
        gc.collect()
    MESH[0] = ParallelMesh.create(ParallelDims(**spec), sequence_parallel=sp, vpp=vpp, timeout_s=90)
    return MESH[0]


def actor(hf, ref, seed=7, lr=1e-3, dtype="fp32", recompute=None, distopt=False):
    """An actor engine holding the reference weights (``recompute``: the model's
    ``recompute_granularity``). The regular optimizer unless ``distopt``: the grads are read
    from ``main_grad``, which the distributed optimizer only reduce-scatters (each DP×CP rank
    would hold the reduced gradient of its own buffer shard only)."""
    from areal_mega.engine import MegatronEngine

    eng = MegatronEngine(
        ModelConfig(dtype=dtype, recompute_granularity=recompute),
        hf_config=hf,
        role="actor",
        mesh=MESH[0],
        optimizer_cfg=OptimizerConfig(lr=lr, clip_grad=0.0),
        seed=seed,
        use_distributed_optimizer=distopt,
    )
    load_reference(eng, ref, hf)
    return eng


def distopt_step(res, tag, hf, ref, my_mbs):
    """One optimizer step (``train_batch``, the reference's production loss) of an actor with
    the distributed optimizer against the same step with the regular one, on the current mesh
    (this rank's ``my_mbs``): ``<tag>.distopt_step`` the largest difference of this rank's
    stepped weights, ``<tag>.distopt_step_change`` the step's own largest change (the check
    is not vacuous), ``<tag>.distopt_kinds`` whether each optimizer is a distributed one."""
    from areal_mega.checkpoint.distopt_state import distributed_optimizers

    def weights(eng):
        return [p.detach().clone() for c in eng.model_chunks() for p in c.parameters()]

    before, stepped, kinds = None, [], []
    for distopt in (False, True):
        eng = actor(hf, ref, distopt=distopt)  # both start from the reference weights
        kinds.append(bool(distributed_optimizers(eng.optimizer)))
        before = weights(eng) if before is None else before
        eng.train_batch(my_mbs, *losses(ref["kind"]), temperature=TEMP)
        stepped.append(weights(eng))
        del eng
    res[f"{tag}.distopt_step"] = max(
        float((a - b).abs().max()) for a, b in zip(stepped[0], stepped[1])
    )
    res[f"{tag}.distopt_step_change"] = max(
        float((a - b).abs().max()) for a, b in zip(stepped[0], before)
    )
    res[f"{tag}.distopt_kinds"] = kinds  # [regular, distributed]: [False, True]


def check_layout(
    res,
    tag,
    hf,
    ref,
    mbs,
    *,
    my_mbs=None,
    my_ref_lps=None,
    dtype="fp32",
    prox=False,
    recompute=None,
):
    """Logprobs (forward_logprobs) and grads (forward_backward) of a layout vs reference, with
    the reference's production loss; ``prox``: again with π_prox taken from the training
    forward (``actor.prox_logprobs=auto``: no ``prox_logprobs`` in the micro-batches);
    ``recompute``: the actor's ``recompute_granularity``."""
    eng = actor(hf, ref, dtype=dtype, recompute=recompute)
    my_mbs = mbs if my_mbs is None else my_mbs
    want = ref["lps"] if my_ref_lps is None else my_ref_lps
    res[f"{tag}.logprobs"] = compare_lps(eng.forward_logprobs(my_mbs, temperature=TEMP), want)
    stats = eng.forward_backward(
        my_mbs, *losses(ref["kind"]), temperature=TEMP, return_entropy=True
    )
    res[f"{tag}.grads"], res[f"{tag}.grads_rel"] = compare_grads(eng, ref, hf)
    res[f"{tag}.loss"] = abs(stats["loss"] - ref["loss"])
    res[f"{tag}.n_tokens"] = abs(stats["n_tokens"] - ref["n_tokens"])
    if prox:
        bare = [{k: v for k, v in mb.items() if k != "prox_logprobs"} for mb in my_mbs]
        stats = eng.forward_backward(
            bare,
            *losses(ref["kind"], prox_from_forward=True),
            temperature=TEMP,
            return_entropy=True,
        )
        res[f"{tag}.prox_from_forward.grads"], _ = compare_grads(eng, ref, hf)
        res[f"{tag}.prox_from_forward.loss"] = abs(stats["loss"] - ref["loss"])
    res[f"{tag}.grad_norm"] = grad_norm_error(eng, ref)
    return eng


def grad_norm_error(eng, ref):
    """|the layout's gradient norm - the reference's| / the reference's: the norm megatron's
    optimizer clips by (each parameter counted once over TP, PP, EP and expert TP duplicates),
    from the gradients the last ``forward_backward`` left (nothing is stepped)."""
    eng.optimizer.prepare_grads()
    return abs(float(eng.optimizer.get_grad_norm()) - ref["grad_norm"]) / ref["grad_norm"]


def scenario_dense(res, out_dir):
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    mbs = make_mbs(1, [[9, 14, 5], [20, 3], [6, 6, 6, 4], [17]])
    # ---- reference + DP2 (each rank half of the micro-batches) on the d2 mesh
    set_mesh(dict(dp=world))
    ref = reference(DENSE, mbs, seed=11, loss=POLICY)
    half = mbs[rank::world]
    check_layout(res, "dp2", DENSE, ref, mbs, my_mbs=half, my_ref_lps=ref["lps"][rank::world])
    # packed = alone: every sequence of mb 0 run on its own
    eng = actor(DENSE, ref)
    worst = 0.0
    mb0 = mbs[0]
    lp0 = eng.forward_logprobs([mb0], temperature=TEMP)[0]
    for b in range(len(mb0["seqlens"])):
        s, n = int(mb0["cu_seqlens"][b]), int(mb0["seqlens"][b])
        alone = pack_sequences([next_token_layout(mb0["input_ids"][s : s + n])])
        worst = max(
            worst,
            (eng.forward_logprobs([alone], temperature=TEMP)[0][:n] - lp0[s : s + n])
            .abs()
            .max()
            .item(),
        )
    res["packed_vs_alone"] = worst
    # checkpoint written from the TP1 (d2) layout, reloaded under TP2 below
    ckpt = os.path.join(out_dir, "ckpt_tp1")
    eng.save(ckpt, extra={"note": "tp1"})
    del eng
    # ---- TP2, then TP2 + sequence parallelism
    set_mesh(dict(tp=world))
    eng = check_layout(res, "tp2", DENSE, ref, mbs, prox=True)
    from areal_mega.engine import MegatronEngine

    fresh = MegatronEngine(
        ModelConfig(dtype="fp32"), hf_config=DENSE, role="ref", mesh=MESH[0], seed=999
    )
    res["tp2.before_reload_differs"] = float(
        compare_lps(fresh.forward_logprobs(mbs, temperature=TEMP), ref["lps"]) > 1e-3
    )
    extra = fresh.load(ckpt)
    res["ckpt_tp1_to_tp2.logprobs"] = compare_lps(
        fresh.forward_logprobs(mbs, temperature=TEMP), ref["lps"]
    )
    res["ckpt_tp1_to_tp2.extra_ok"] = float(extra == {"note": "tp1"})
    # ten train steps on a fixed batch lower the loss (TP2)
    fns = losses(POLICY)
    trace = [eng.train_batch(mbs, *fns, temperature=TEMP)["loss"] for _ in range(10)]
    res["train10.first_loss"], res["train10.last_loss"] = trace[0], trace[-1]
    res["train10.adam_fused"] = float(all(g["fused"] for g in eng.optimizer.optimizer.param_groups))
    del eng, fresh
    set_mesh(dict(tp=world), sp=True)
    check_layout(res, "tp2sp", DENSE, ref, mbs)
    # ---- a large vocabulary, untied and tied, DP2: embedding and output layer gradients added
    # into their main gradients in the backward
    for name, hf in (("big_untied", DENSE), ("big_tied", TIED)):
        hf = dict(hf, vocab_size=BIG_VOCAB)
        set_mesh(dict(dp=world))
        ref_v = reference(hf, mbs, seed=13, loss=POLICY)
        check_layout(
            res, f"dp2_{name}", hf, ref_v, mbs, my_mbs=half, my_ref_lps=ref_v["lps"][rank::world]
        )
    # ---- Qwen2 (QKV bias) under TP2 + SP
    set_mesh(dict(dp=world))
    ref_b = reference(BIAS, mbs, seed=5, loss=POLICY)
    set_mesh(dict(tp=world), sp=True)
    check_layout(res, "qwen2_tp2sp", BIAS, ref_b, mbs)
    # ---- PP2 on tied llama: variable lengths, 6 micro-batches
    pp_mbs = make_mbs(2, [[9, 14, 5], [31], [4, 4], [12, 7, 9], [2, 25], [8]])
    set_mesh(dict(dp=world))
    ref_t = reference(TIED, pp_mbs, seed=3, loss=GSPO)
    set_mesh(dict(pp=world))
    check_layout(res, "pp2_tied", TIED, ref_t, pp_mbs, prox=True)
    group_batches.shared_prompt_layouts(res, world, sys.modules[__name__])


def scenario_moe(res, out_dir):
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    mbs = make_mbs(4, [[9, 14, 5], [20, 3], [6, 6, 6, 4], [17]])
    set_mesh(dict(dp=world))
    ref = reference(MOE, mbs, seed=21, loss="sft")
    # EP2 (alltoall dispatcher) inside DP2: each rank half of the micro-batches
    set_mesh(dict(dp=world, ep=world))
    check_layout(
        res, "ep2", MOE, ref, mbs, my_mbs=mbs[rank::world], my_ref_lps=ref["lps"][rank::world]
    )
    # EP1 + TP2 (expert tensor parallel = TP)
    set_mesh(dict(tp=world), sp=True)
    check_layout(res, "moe_tp2sp", MOE, ref, mbs)
    # TP2 with the experts whole on each rank (expert TP 1: expert DP 2 over the TP ranks)
    set_mesh(dict(tp=world, etp=1), sp=True)
    check_layout(res, "moe_tp2sp_etp1", MOE, ref, mbs)


#: TransformerEngine has no fp32 backend for packed (THD) attention (its unfused attention
#: refuses THD, flash / cuDNN fused attention need fp16 / bf16), so the GPU scenarios run bf16.
GPU_DTYPE = "bf16"


def _engine_reference(hf, mbs, seed, loss):
    """GPU reference: the engine itself at CP1 (TE THD attention, bf16) on a d=world mesh, every
    rank the full batch. The global denominator sums the DP ranks (world × one batch's) and DDP
    sums their gradients, so ``main_grad`` and the summed ``loss`` already equal one rank's
    single-batch values: nothing is rescaled by the world size."""
    from areal_mega.engine import MegatronEngine

    eng = MegatronEngine(
        ModelConfig(dtype=GPU_DTYPE),
        hf_config=hf,
        role="actor",
        mesh=MESH[0],
        optimizer_cfg=OptimizerConfig(lr=1e-3, clip_grad=0.0),
        seed=seed,
        use_distributed_optimizer=False,
    )
    state = {
        k: v.detach().clone()
        for k, v in eng.model_chunks()[0].state_dict().items()
        if not k.endswith("_extra_state")
    }
    lps = eng.forward_logprobs(mbs, temperature=TEMP)
    if loss != "sft":
        for i, (mb, lp) in enumerate(zip(mbs, lps)):
            attach_policy_inputs(mb, lp, seed * 100 + i)
    loss_fn, den_fn = losses(loss)
    st = eng.forward_backward(mbs, loss_fn, den_fn, temperature=TEMP, return_entropy=True)
    grads = {n: p.main_grad.detach().clone() for n, p in eng.model_chunks()[0].named_parameters()}
    return {
        "state": state,
        "lps": lps,
        "grads": grads,
        "loss": st["loss"],
        "kind": loss,
        "n_tokens": float(sum(den_fn(mb) for mb in mbs)),
    }


def scenario_gpu_thd(res, out_dir):
    """One GPU: TransformerEngine THD packed forward equals each sequence run alone; the
    effect of letting a sequence see its predecessor is recorded for scale."""
    set_mesh(dict(dp=1))
    mbs = make_mbs(1, [[9, 14, 5, 30]])
    ref = _engine_reference(DENSE, mbs, seed=11, loss=POLICY)
    worst, leak = 0.0, 0.0
    mb0 = mbs[0]
    lp0 = ref["lps"][0]
    e2 = actor(DENSE, ref, dtype=GPU_DTYPE)
    for b in range(len(mb0["seqlens"])):
        s, n = int(mb0["cu_seqlens"][b]), int(mb0["seqlens"][b])
        alone = pack_sequences([next_token_layout(mb0["input_ids"][s : s + n])])
        lp_alone = e2.forward_logprobs([alone], temperature=TEMP)[0][:n]
        worst = max(worst, (lp_alone - lp0[s : s + n]).abs().max().item())
        if b:  # the same tokens as the tail of one sequence that starts at sequence b-1
            p = int(mb0["cu_seqlens"][b - 1])
            joined = pack_sequences([next_token_layout(mb0["input_ids"][p : s + n])])
            lp_j = e2.forward_logprobs([joined], temperature=TEMP)[0][s - p : s - p + n - 1]
            leak = max(leak, (lp_j - lp_alone[: n - 1]).abs().max().item())
    res["thd.packed_vs_alone"] = worst
    res["thd.joined_vs_alone"] = leak


def scenario_gpu_cp2(res, out_dir):
    """Two GPUs: context parallelism 2 (zigzag THD, bf16) equals CP1, with a sequence-level
    policy loss (GSPO ratio, mean of sequence means) so the loss's cross-rank sums are used."""
    world = int(os.environ["WORLD_SIZE"])
    mbs = make_mbs(1, [[9, 14, 5], [20, 3], [6, 6, 6, 4]], pad=2 * world, cp=world)
    set_mesh(dict(dp=world))
    ref = _engine_reference(DENSE, mbs, seed=11, loss=GSPO)
    set_mesh(dict(cp=world))
    check_layout(res, "cp2", DENSE, ref, mbs, dtype=GPU_DTYPE)


def scenario_vpp(res, out_dir):
    """PP2 × VPP2 (interleaved schedule, tied llama, 4 layers): logprobs, gradients and one
    train step (loss, updated parameters) against the single-rank reference, with micro-batches
    of one packed length and of variable lengths."""
    world = int(os.environ["WORLD_SIZE"])
    tied4 = dict(TIED, num_hidden_layers=4)
    cases = {
        "vpp_same": make_mbs(5, [[9, 14, 5], [20, 8], [6, 6, 6, 10], [28]]),
        "vpp_var": make_mbs(6, [[9, 14, 5], [31], [4, 4], [12, 7, 9]]),
    }
    for tag, mbs in cases.items():
        set_mesh(dict(dp=world))
        ref = reference(tied4, mbs, seed=3, loss=GSPO)
        before = actor(tied4, ref)  # single-rank train step: the reference step
        stats = before.train_batch(mbs, *losses(GSPO), temperature=TEMP)
        stepped = {n: p.detach().clone() for n, p in before.model_chunks()[0].named_parameters()}
        res[f"{tag}.step_moved"] = max(
            (stepped[n] - ref["state"][n]).abs().max().item() for n in stepped
        )
        del before
        MESH[0].destroy()
        from areal_mega.parallel.allocation import ParallelDims
        from areal_mega.parallel.mesh import ParallelMesh

        MESH[0] = ParallelMesh.create(ParallelDims(pp=world), vpp=2, timeout_s=90)
        eng = check_layout(res, tag, tied4, ref, mbs)
        try:
            eng.forward_logprobs(mbs[:3])
        except ValueError as e:
            res["vpp.odd_count_error"] = str(e)
        eng.optimizer.zero_grad()
        got = eng.train_batch(mbs, *losses(GSPO), temperature=TEMP)
        res[f"{tag}.step_loss"] = abs(got["loss"] - stats["loss"])
        res[f"{tag}.step_params"] = max(
            (p.detach() - shard_of(stepped[global_name(n, c, eng.mesh, tied4)], p, n, eng.mesh))
            .abs()
            .max()
            .item()
            for c in eng.model_chunks()
            for n, p in c.named_parameters()
        )
        del eng


def scenario_cpu(res, out_dir):
    """The CPU scenarios (dense, MoE, interleaved pipeline) in one pair of processes."""
    for scenario in (scenario_dense, scenario_moe, scenario_vpp):
        scenario(res, out_dir)


def finish_rank(res: dict, path: str) -> int:
    """A worker rank's end: its results as JSON at ``path``, its process groups destroyed;
    the exit code says whether ``res`` holds an error."""
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    if MESH[0] is not None:
        try:
            MESH[0].destroy(process_group=True)
        except Exception:
            pass
    return 0 if "error" not in res else 1


def run_scenario(scenarios: dict, res: dict = None) -> int:
    """One worker rank, argv ``scenario rank world port out_dir``: run
    ``scenarios[scenario](res, out_dir)`` on a gloo rank of this world, an exception recorded
    as ``res["error"]``, then :func:`finish_rank` to ``<out_dir>/<scenario>.<rank>.json``."""
    scenario, rank, world, port, out_dir = sys.argv[1:6]
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    res = {} if res is None else res
    try:
        scenarios[scenario](res, out_dir)
    except Exception:
        res["error"] = traceback.format_exc()
    return finish_rank(res, os.path.join(out_dir, f"{scenario}.{rank}.json"))


def main():
    return run_scenario(
        {
            "dense": scenario_dense,
            "moe": scenario_moe,
            "vpp": scenario_vpp,
            "gpu_thd": scenario_gpu_thd,
            "gpu_cp2": scenario_gpu_cp2,
            "cpu": scenario_cpu,
        }
    )


if __name__ == "__main__":
    sys.exit(main())
