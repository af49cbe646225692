"""Make megatron-core 0.19.2 run on CPU-only torch (gloo), for tests and the CPU demo.

megatron-core assumes CUDA in a handful of places: the tensor-parallel RNG tracker keeps CUDA
generator states, several modules call ``torch.cuda.current_device()`` / ``synchronize()`` /
``Stream()`` or build tensors with ``device="cuda"``, and the optimizers compare
``param.type()`` with ``"torch.cuda.FloatTensor"``. This module patches exactly those places
when CUDA is absent, plus five patches for speed:

- the tensor-parallel linear layers' GEMMs go through oneDNN (:mod:`areal_mega.compat.cpu_gemm`;
  on AMD CPUs MKL's fp32 GEMM runs at less than half the rate);
- RoPE over packed sequences runs as one call, not one per sequence
  (:mod:`areal_mega.compat.packed_rope`);
- the Adam megatron falls back to is torch's fused CPU kernel;
- its fallback tensor-list scale and copy (the gradient clip, the bf16 parameters' update) are
  torch's ``_foreach`` ops (:mod:`areal_mega.compat.multi_tensor`);
- DDP adds a bf16 gradient into its fp32 main gradient in cache-sized pieces
  (:mod:`areal_mega.compat.main_grad`).

Gated delta-net layers (Qwen3-Next, Qwen3.5) get torch versions of fla's kernels
(:mod:`areal_mega.compat.gdn_cpu`). Where TransformerEngine is absent, :func:`apply` also
installs the scoped TE placeholder of :mod:`areal_mega.compat.te_placeholder` (``import
megatron.bridge`` needs it).

Every patch names the module (and function) it patches and the source text it expects to find
there. :func:`apply` checks all of them *before* changing anything and raises
:class:`CompatError` listing each mismatch, so a megatron-core upgrade that moves or fixes the
code fails loudly instead of silently running unpatched. ``tests/test_engine_compat.py`` also
re-checks, in a fresh process without the patches, that upstream still fails without them.

Three kinds of patch are used (and ``custom`` ones, a function of this module each):

* **module torch view** — inside one megatron module, the name ``torch`` is rebound to a thin
  view of the real ``torch`` whose ``torch.cuda`` is a CPU stand-in (``current_device()`` is
  ``"cpu"``, ``synchronize`` / streams / events are no-ops, the RNG calls use the CPU
  generator) and whose tensor factories map ``device="cuda"`` to the CPU. Code in other
  modules, and ``torch`` itself, is untouched.
* **source rewrite** — one function is recompiled from its own source with listed textual
  replacements (e.g. ``'torch.cuda.FloatTensor'`` → ``'torch.FloatTensor'``).
* **TE placeholder** — the module's import of ``transformer_engine`` is served a placeholder
  while (only while) that module's body runs; its source is read from disk, not imported.

The CPU stand-ins themselves live in :mod:`areal_mega.compat.cuda_shim`, and how one patch is
described, checked and applied in :mod:`areal_mega.compat.patching`; this module holds the
patch list and the one entry point. Usage: ``from areal_mega.compat import megatron_cpu;
megatron_cpu.apply()`` before building models (idempotent; a no-op when CUDA is available
unless ``force=True``).
"""

from __future__ import annotations

import importlib
import inspect
import textwrap
from typing import Optional

import torch

from areal_mega.compat import packed_rope, te_placeholder
from areal_mega.compat.cuda_shim import torch_view
from areal_mega.compat.patching import Patch, rewrite_function

__all__ = [
    "apply",
    "is_applied",
    "needed",
    "CompatError",
    "Patch",
    "PATCHES",
    "check_targets",
    "install_te_placeholder",
    "BRIDGE_TORCH_VIEW_MODULES",
    "bridge_patches",
    "apply_bridge_patches",
    "MEGATRON_CORE_VERSION",
]

#: The megatron-core release these patches were written and measured against.
MEGATRON_CORE_VERSION = "0.19.2"


class CompatError(RuntimeError):
    """The megatron-core source no longer matches what a CPU patch expects."""


# ---- custom patches ------------------------------------------------------------------------


def _patch_rng(mod) -> None:
    """Keep the tensor-parallel RNG tracker's states as CPU generator states."""

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mod._get_cuda_rng_state = get_state
    mod._set_cuda_rng_state = set_state
    mod.torch = torch_view()  # add(): torch.cuda.get_rng_state / manual_seed


def _patch_torch_norm(mod) -> None:
    """``WrappedTorchNorm`` refuses sequence parallelism; on CPU build it with SP off and tag
    its parameters ``sequence_parallel=True`` so their grads are all-reduced over TP like
    megatron's own norms (``finalize_model_grads`` does that)."""
    cls = mod.WrappedTorchNorm
    orig_new = cls.__new__

    def __new__(
        klass,
        config,
        hidden_size,
        eps=1e-5,
        persist_layer_norm=False,
        zero_centered_gamma=False,
        normalization="LayerNorm",
    ):
        sp = config.sequence_parallel
        if sp:
            import copy

            config = copy.copy(config)
            config.sequence_parallel = False
        module = orig_new(
            klass, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma, normalization
        )
        if sp:
            for p in module.parameters():
                p.sequence_parallel = True
        return module

    cls.__new__ = staticmethod(__new__)


_TORCH_VIEW_MODULES = {
    # module: (snippets that must exist, why)
    "megatron.core.models.common.embeddings.rotary_pos_embedding": (
        ("torch.cuda.current_device()",),
        "RoPE inv_freq placed on torch.cuda.current_device()",
    ),
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding": (
        ("torch.cuda.current_device()",),
        "YaRN's frequency tables moved to torch.cuda.current_device()",
    ),
    "megatron.core.transformer.dot_product_attention": (
        ("device=torch.cuda.current_device()",),
        "softmax offsets (attention sinks) allocated on the CUDA device",
    ),
    "megatron.core.pipeline_parallel.schedules": (
        ('device="cuda"',),
        "schedules count tokens in a CUDA tensor",
    ),
    "megatron.core.pipeline_parallel.p2p_communication": (
        ("torch.cuda.current_device()", "torch.cuda.synchronize()"),
        "p2p buffers on the CUDA device and synchronize()",
    ),
    "megatron.core.optimizer.optimizer": (
        ("torch.cuda",),
        "optimizer found-inf / grad-norm tensors on CUDA",
    ),
    "megatron.core.optimizer.clip_grads": (("device='cuda'",), "grad-norm accumulators on CUDA"),
    "megatron.core.optimizer.distrib_optimizer": (
        ("torch.cuda",),
        "distributed optimizer buffers on CUDA",
    ),
    "megatron.core.distributed.param_and_grad_buffer": (
        ("torch.cuda.current_device()",),
        "param/grad buffers on CUDA",
    ),
    "megatron.core.distributed.distributed_data_parallel": (("torch.cuda",), "DDP streams on CUDA"),
    "megatron.core.transformer.moe.token_dispatcher": (
        ("torch.cuda.Stream()", "torch.cuda.current_stream()"),
        "alltoall dispatcher's D2H stream and events",
    ),
    "megatron.core.utils": (
        ("device=torch.cuda.current_device()",),
        "GlobalMemoryBuffer (attention scores buffer) allocates on the CUDA device",
    ),
    "megatron.core.transformer.moe.router": (
        ("device=torch.cuda.current_device()",),
        "router moves its weight to the CUDA device",
    ),
    "megatron.core.dist_checkpointing.strategies.filesystem_async": (
        ("torch.cuda.synchronize()",),
        "checkpoint writer synchronizes CUDA before copying",
    ),
    "megatron.core.dist_checkpointing.strategies.state_dict_saver": (
        ("device='cuda'", "device=torch.cuda.current_device()"),
        "checkpoint save all-reduces flags in CUDA tensors",
    ),
    "megatron.core.dist_checkpointing.strategies.fully_parallel": (
        ("torch.cuda.synchronize()",),
        "fully-parallel save/load synchronizes CUDA",
    ),
    "megatron.core.dist_checkpointing.strategies.async_utils": (
        ("device=torch.cuda.current_device()", "torch.cuda.synchronize()"),
        "async save queue uses CUDA tensors and synchronize",
    ),
    "megatron.core.dist_checkpointing.exchange_utils": (
        ('device="cuda"',),
        "shard exchange buffers on cuda",
    ),
    "megatron.core.tensor_parallel.mappings": (
        ("device=torch.cuda.current_device()",),
        "sequence-parallel gather/scatter buffers on the CUDA device",
    ),
    "megatron.core.tensor_parallel.layers": (
        ("device=torch.cuda.current_device()",),
        "sequence-parallel all-gather buffer in linear backward on the CUDA device",
    ),
    "megatron.core.transformer.utils": (
        ('torch.ones(sq, sq, device="cuda")',),
        "get_default_causal_mask builds on cuda",
    ),
}


# the three GEMMs of the tensor-parallel linear layers -> oneDNN (see compat/cpu_gemm.py)
_TP_GEMM_REWRITES = {
    "LinearWithGradAccumulationAndAsyncCommunication.forward": (
        (
            "output = torch.matmul(total_input, weight.t())",
            "output = _areal_cpu_gemm.linear(total_input, weight)",
        ),
    ),
    "LinearWithGradAccumulationAndAsyncCommunication.backward": (
        (
            "grad_input = grad_output.matmul(weight)",
            "grad_input = _areal_cpu_gemm.grad_input(grad_output, weight)",
        ),
        (
            "grad_weight = grad_output.t().matmul(total_input)",
            "grad_weight = _areal_weight_grad(grad_output, total_input, weight)",
        ),
    ),
    "LinearWithFrozenWeight.forward": (
        (
            "output = torch.matmul(input, weight.t())",
            "output = _areal_cpu_gemm.linear(input, weight)",
        ),
    ),
    "LinearWithFrozenWeight.backward": (
        (
            "grad_input = grad_output.matmul(weight)",
            "grad_input = _areal_cpu_gemm.grad_input(grad_output, weight)",
        ),
        # the >2-D branch (0.19) folds the leading dims first
        (
            "grad_input = grad_output_2d.matmul(weight)",
            "grad_input = _areal_cpu_gemm.grad_input(grad_output_2d, weight)",
        ),
    ),
}


def _patch_tp_gemms(mod) -> None:
    """Recompile the autograd functions' ``forward`` / ``backward`` (decorators included:
    ``@staticmethod`` and megatron's ``custom_fwd`` / ``custom_bwd`` are re-applied from the
    source) with their matmuls calling :mod:`areal_mega.compat.cpu_gemm`, and a large trained
    weight's gradient added into its main gradient (:func:`areal_mega.compat.main_grad.
    weight_grad`)."""
    from areal_mega.compat import cpu_gemm, main_grad

    mod._areal_cpu_gemm = cpu_gemm
    mod._areal_weight_grad = main_grad.weight_grad
    for qualname, pairs in _TP_GEMM_REWRITES.items():
        cls_name, meth = qualname.split(".")
        cls = getattr(mod, cls_name)
        orig = cls.__dict__[meth].__func__
        src = textwrap.dedent(inspect.getsource(orig))
        for old, new in pairs:
            src = src.replace(old, new)
        ns: dict = {}
        exec(compile(src, inspect.getsourcefile(orig) or "<rewrite>", "exec"), mod.__dict__, ns)
        ns[meth].__func__.__wrapped_original__ = orig
        setattr(cls, meth, ns[meth])


def _patch_packed_rope(mod) -> None:
    packed_rope.install(mod)


_DDP_GRAD_ADD = "param.main_grad.add_(param.grad.data)"


def _patch_ddp_grad_add(mod) -> None:
    """DDP's backward hook adds a parameter's gradient into its main gradient through
    :func:`areal_mega.compat.main_grad.accumulate`."""
    from areal_mega.compat import main_grad

    mod._areal_accumulate_grad = main_grad.accumulate
    rewrite_function(
        mod,
        "DistributedDataParallel._make_backward_post_hook",
        ((_DDP_GRAD_ADD, "_areal_accumulate_grad(param.main_grad, param.grad.data)"),),
    )


_EMBEDDING_LOOKUP = "output_parallel = F.embedding(masked_input, weight)"


def _patch_embedding_grad(mod) -> None:
    """``VocabParallelEmbedding`` looks its rows up through :func:`areal_mega.compat.
    embedding_grad.embedding`, whose backward adds them into the weight's main gradient."""
    from areal_mega.compat import embedding_grad

    mod._areal_embedding = embedding_grad.embedding
    rewrite_function(
        mod,
        "VocabParallelEmbedding.forward",
        ((_EMBEDDING_LOOKUP, "output_parallel = _areal_embedding(masked_input, weight)"),),
    )


def _patch_multi_tensor_scale(mod) -> None:
    """The module's fallback ``multi_tensor_scale_impl`` (megatron's local one, bound at its
    import when TE and apex are absent) becomes :func:`areal_mega.compat.multi_tensor.
    multi_tensor_scale`. A TE or apex kernel found at import is left in place."""
    from megatron.core.utils import local_multi_tensor_scale

    from areal_mega.compat import multi_tensor

    if mod.multi_tensor_scale_impl is local_multi_tensor_scale:
        mod.multi_tensor_scale_impl = multi_tensor.multi_tensor_scale


#: GatedDeltaNet's helpers megatron decorates with ``jit_fuser`` (``torch.compile``)
_GDN_COMPILED = (
    "_apply_gated_norm",
    "_prepare_input_for_gated_delta_rule",
    "_compute_g_and_beta",
)


def _patch_gated_delta_net(mod) -> None:
    """Gated delta-net layers on the CPU: fla's kernels served by :mod:`areal_mega.compat.
    gdn_cpu` (packed sequences included), ``torch.cuda.current_device()`` mapped to the CPU,
    and the ``jit_fuser`` helpers run as plain functions (``torch.compile`` would compile them
    with inductor's C++ backend, again for every new packed length)."""
    from areal_mega.compat import gdn_cpu

    gdn_mod = importlib.import_module("megatron.core.ssm.gated_delta_net.gdn")
    gdn_cpu.install(mod, gdn_mod)
    mod.torch = torch_view()
    gdn_mod.torch = torch_view()
    for name in _GDN_COMPILED:
        fn = mod._GDNBase.__dict__[name]
        setattr(mod._GDNBase, name, getattr(fn, "_torchdynamo_orig_callable", fn))


# MLA's column-parallel kv-down branch (local spec): after the TP gather, the rotary key columns
# (full sequence, read by this rank's heads only) get an all-reduce in backward (forward:
# identity), so that the rank owning those columns receives every head's gradient. One line,
# so that it fits whatever the indentation of the recompiled method is.
_MLA_KV_GATHER = "kv_combined = gather_from_tensor_model_parallel_region(kv_combined)"
_MLA_KV_GATHER_SUMMED_ROPE = (
    _MLA_KV_GATHER + "; kv_combined = torch.cat([kv_combined[..., :self.config.kv_lora_rank], "
    "tensor_parallel.copy_to_tensor_model_parallel_region("
    "kv_combined[..., self.config.kv_lora_rank:])], dim=-1)"
)


_EXPERT_BIAS_INPLACE = "output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)"
_EXPERT_BIAS_ADDED = "output = output + output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)"


def _patch_mamba_mixer(mod) -> None:
    """Mamba-2 layers on the CPU: causal-conv1d's and mamba-ssm's kernels served by
    :mod:`areal_mega.compat.mamba_cpu` (packed sequences through ``seq_idx``), the gated
    RMSNorm class megatron's ``ExtendedRMSNorm`` subclasses, and ``torch.cuda.current_device()``
    mapped to the CPU."""
    from areal_mega.compat import mamba_cpu

    mamba_cpu.install(mod)
    mod.torch = torch_view()


def _patch_hybrid_final_norm(mod) -> None:
    """The hybrid stack's final norm (hard-coded to TransformerEngine's ``TENorm``) as torch's
    norm, the one the local hybrid spec's layers use (areal_mega/models/nemotron_h.py)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    mod.TENorm = WrappedTorchNorm


def _patch_absorbed_mla_linear(mod) -> None:
    """Our replicated linear (:mod:`.replicated_linear`) as the down projection DeepSeek sparse
    attention's absorbed MLA accepts in place of its TE-only ``Linear``."""
    from .replicated_linear import ReplicatedLinear

    mod.Linear = ReplicatedLinear


def _build_patches() -> list[Patch]:
    patches = [
        Patch(
            "rng_tracker",
            "megatron.core.tensor_parallel.random",
            "custom",
            expect=(
                "def _get_cuda_rng_state(",
                "def _set_cuda_rng_state(",
                "torch.cuda.get_rng_state()",
                "torch.cuda.manual_seed(seed)",
            ),
            fn=_patch_rng,
            why="TP RNG tracker keeps CUDA generator states",
        ),
        Patch(
            "torch_norm_sp",
            "megatron.core.transformer.torch_norm",
            "custom",
            expect=("class WrappedTorchNorm", "sequence_parallel"),
            fn=_patch_torch_norm,
            why="WrappedTorchNorm refuses sequence parallelism",
        ),
        Patch(
            "optimizer_param_type",
            "megatron.core.optimizer.optimizer",
            "rewrite",
            function="Float16OptimizerWithFloat16Params.__init__",
            replace=(
                ("'torch.cuda.FloatTensor'", "'torch.FloatTensor'"),
                (
                    "['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']",
                    "['torch.HalfTensor', 'torch.BFloat16Tensor']",
                ),
            ),
            why="compares param.type() with CUDA tensor type names",
        ),
        Patch(
            "distopt_param_type",
            "megatron.core.optimizer.distrib_optimizer",
            "rewrite",
            function="DistributedOptimizer._build_model_and_main_param_groups",
            replace=(
                ("'torch.cuda.FloatTensor'", "'torch.FloatTensor'"),
                (
                    "['torch.cuda.HalfTensor', 'torch.cuda.BFloat16Tensor']",
                    "['torch.HalfTensor', 'torch.BFloat16Tensor']",
                ),
            ),
            why="compares param.type() with CUDA tensor type names",
        ),
        Patch(
            "tied_embedding_sync",
            "megatron.core.models.common.language_module.language_module",
            "rewrite",
            function="LanguageModule.setup_embeddings_and_output_layer",
            replace=(("weight.data = weight.data.cuda()", "weight.data = weight.data"),),
            why="moves the tied output-layer copy to CUDA before the PP all-reduce",
        ),
        Patch(
            "moe_splits_numpy",
            "megatron.core.transformer.moe.moe_utils",
            "rewrite",
            function="maybe_move_tensor_to_cpu",
            replace=(
                (
                    "if torch.is_tensor(tensor) and tensor.is_cuda:",
                    "if torch.is_tensor(tensor) and (tensor.is_cuda or as_numpy):",
                ),
            ),
            why="alltoall split sizes become numpy only for CUDA tensors; gloo's "
            "all_to_all_single then receives tensors instead of int lists",
        ),
        Patch(
            "mla_k_pos_emb_grad",
            "megatron.core.transformer.multi_latent_attention",
            "rewrite",
            function="MLASelfAttention.get_query_key_value_tensors",
            expect=(_MLA_KV_GATHER,),
            replace=((_MLA_KV_GATHER, _MLA_KV_GATHER_SUMMED_ROPE),),
            why="local-spec MLA (column-parallel kv down projection, no TE): the shared "
            "rotary key is used by every TP rank's heads but its gradient is not summed "
            "over TP (TE's duplicated projection sums it in the sequence-parallel "
            "gather's backward)",
        ),
        Patch(
            "expert_bias_inplace",
            "megatron.core.transformer.mlp",
            "rewrite",
            function="MLP.forward",
            expect=(_EXPERT_BIAS_INPLACE,),
            replace=((_EXPERT_BIAS_INPLACE, _EXPERT_BIAS_ADDED),),
            why="local-spec experts with biases (GPT-OSS) add the fc2 bias in place to the "
            "row-parallel output, which at expert-TP 1 is the reduce's own output returned as "
            "a view: autograd refuses the in-place update in training (TE's grouped experts "
            "take another path)",
        ),
        Patch(
            "clip_grads_type",
            "megatron.core.optimizer.clip_grads",
            "rewrite",
            function="clip_grad_by_total_norm_fp32",
            replace=(
                (
                    "param.grad.type() == 'torch.cuda.FloatTensor'",
                    "param.grad.dtype == torch.float32",
                ),
            ),
            why="asserts grads are torch.cuda.FloatTensor",
        ),
        Patch(
            "cpu_fused_adam",
            "megatron.core.optimizer",
            "rewrite",
            function="_get_megatron_optimizer_based_on_param_groups",
            expect=("adam_cls = torch.optim.AdamW if config.decoupled_weight_decay",),
            replace=(
                (
                    "optimizer = adam_cls(**kwargs)",
                    "optimizer = adam_cls(**kwargs, **({'fused': True} "
                    "if USING_PYTORCH_OPTIMIZER else {}))",
                ),
            ),
            why="speed, not correctness: without TE/apex megatron builds torch's AdamW "
            "with its defaults, the per-parameter loop on CPU tensors (~10 passes over "
            "the weights); torch's fused CPU kernel makes one (135M params, 2 threads: "
            "0.42 s -> 0.07 s a step)",
        ),
        Patch(
            "ddp_grad_add",
            "megatron.core.distributed.distributed_data_parallel",
            "custom",
            function="DistributedDataParallel._make_backward_post_hook",
            expect=(_DDP_GRAD_ADD,),
            fn=_patch_ddp_grad_add,
            why="speed, not correctness: a bf16 gradient is cast into a full-size fp32 "
            "temporary before its add into the fp32 main gradient (compat/main_grad.py)",
        ),
        Patch(
            "embedding_grad_into_main_grad",
            "megatron.core.tensor_parallel.layers",
            "custom",
            function="VocabParallelEmbedding.forward",
            expect=(_EMBEDDING_LOOKUP,),
            fn=_patch_embedding_grad,
            why="speed, not correctness: the lookup's backward builds a dense gradient of the "
            "whole vocabulary table to move the batch's rows (compat/embedding_grad.py)",
        ),
        Patch(
            "clip_grads_multi_tensor_scale",
            "megatron.core.optimizer.clip_grads",
            "custom",
            expect=(
                "multi_tensor_scale_impl = local_multi_tensor_scale",
                "multi_tensor_scale_impl, dummy_overflow_buf, [grads, grads], clip_coeff",
            ),
            fn=_patch_multi_tensor_scale,
            why="speed, not correctness: megatron's fallback scales the clipped gradients "
            "through a full-size temporary per parameter (compat/multi_tensor.py)",
        ),
        Patch(
            "optimizer_multi_tensor_scale",
            "megatron.core.optimizer.optimizer",
            "custom",
            expect=(
                "multi_tensor_scale_impl = local_multi_tensor_scale",
                "multi_tensor_applier(multi_tensor_scale_impl, overflow_buf, [this, that], 1.0)",
            ),
            fn=_patch_multi_tensor_scale,
            why="speed, not correctness: megatron's fallback copies the fp32 main parameters "
            "into the bf16 model ones through an fp32 temporary per parameter "
            "(compat/multi_tensor.py)",
        ),
        Patch(
            "tp_linear_gemms",
            "megatron.core.tensor_parallel.layers",
            "custom",
            expect=tuple(old for pairs in _TP_GEMM_REWRITES.values() for old, _ in pairs),
            fn=_patch_tp_gemms,
            why="speed, not correctness: torch's fp32 matmul on CPU is MKL's sgemm, which "
            "on AMD CPUs runs at under half of oneDNN's rate (compat/cpu_gemm.py); a large "
            "weight's full-size gradient faults in fresh pages every step (compat/main_grad.py)",
        ),
        Patch(
            "mamba_mixer_kernels",
            "megatron.core.ssm.mamba_mixer",
            "custom",
            expect=(
                "from causal_conv1d import causal_conv1d_fn",
                "from mamba_ssm.ops.triton.layernorm_gated import RMSNorm as RMSNormGated",
                "mamba_split_conv1d_scan_combined,",
                "class ExtendedRMSNorm(RMSNormGated):",
                "if not HAVE_MAMBA_SSM:",
                "y = mamba_split_conv1d_scan_combined(",
                "seq_idx = packed_seq_params.seq_idx",
                "_check_mamba_sequence_packing_support(for_inference_not_training=False)",
                "device=torch.cuda.current_device()",
            ),
            fn=_patch_mamba_mixer,
            why="MambaMixer (Nemotron-H, Falcon-H1) needs causal-conv1d's CUDA and mamba-ssm's "
            "Triton kernels (compat/mamba_cpu.py)",
        ),
        Patch(
            "hybrid_final_norm",
            "megatron.core.models.hybrid.hybrid_block",
            "custom",
            expect=("self.final_norm = TENorm(",),
            fn=_patch_hybrid_final_norm,
            why="HybridStack's final norm is TransformerEngine's TENorm whatever the spec",
        ),
        Patch(
            "packed_thd_rope",
            "megatron.core.models.common.embeddings.rope_utils",
            "custom",
            function="_apply_rotary_pos_emb_thd",
            expect=(
                "Apply RoPE one sequence at a time",
                "for x in sequence_splits:",
                "_get_thd_freqs_on_this_cp_rank(cp_rank, cp_size, x, freqs)",
                "_apply_rotary_pos_emb_bshd(",
            ),
            fn=_patch_packed_rope,
            why="speed, not correctness: 0.19's unfused THD RoPE loops over the packed "
            "sequences; one call over the packed tensor (compat/packed_rope.py)",
        ),
        Patch(
            "absorbed_mla_local_linear",
            "megatron.core.transformer.experimental_attention_variant.absorbed_mla",
            "custom",
            expect=(
                "    from megatron.core.post_training.modelopt.layers import Linear\n",
                "TEColumnParallelLinear, TELinear, Linear, set_save_original_input = None, None, "
                "None, None",
                "            Linear,\n            TEColumnParallelLinear,\n",
            ),
            fn=_patch_absorbed_mla_linear,
            why="DeepSeek sparse attention's absorbed MLA accepts a replicated down projection "
            "by identity only, its torch Linear imported with TE's modules (None without TE); "
            "a column-parallel one loses gradient under sequence parallelism",
        ),
        Patch(
            "gated_delta_net_fla",
            "megatron.core.ssm.gated_delta_net.common",
            "custom",
            expect=(
                "from fla.modules.convolution import causal_conv1d",
                "from fla.ops.gated_delta_rule import chunk_gated_delta_rule",
                "HAVE_FLA = False",
                "query_key = l2norm(query_key.contiguous())",
                "device=torch.cuda.current_device()",
            )
            + tuple(f"def {name}(" for name in _GDN_COMPILED),
            fn=_patch_gated_delta_net,
            why="GatedDeltaNet (Qwen3-Next, Qwen3.5) needs fla's Triton kernels, and its torch "
            "fallback (deterministic mode) refuses packed sequences",
        ),
    ]
    for module, (snips, why) in _TORCH_VIEW_MODULES.items():
        patches.append(
            Patch(
                "torch_view:" + module.rsplit(".", 1)[-1],
                module,
                "torch_view",
                expect=snips,
                why=why,
            )
        )
    for module, line in te_placeholder.IMPORTERS.items():
        patches.append(
            Patch(
                "te_placeholder:" + module.rsplit(".", 1)[-1],
                module,
                "te_placeholder",
                expect=(line,),
                why="imports transformer_engine unconditionally (megatron-bridge)",
            )
        )
    return patches


PATCHES: list[Patch] = _build_patches()
_APPLIED = False


def needed() -> bool:
    """True when the patches are needed: CUDA is not available."""
    return not torch.cuda.is_available()


def is_applied() -> bool:
    return _APPLIED


def check_targets(patches: Optional[list[Patch]] = None) -> list[str]:
    """Check every patch's expected source without changing anything; return the problems."""
    probs: list[str] = []
    for p in patches or PATCHES:
        probs.extend(p.check())
    return probs


#: Megatron-Bridge modules that place tensors on ``torch.cuda.current_device()``: patched
#: on demand by :func:`apply_bridge_patches` (importing the bridge takes ~20 s, so they are not
#: part of :data:`PATCHES`, which every CPU process applies)
BRIDGE_TORCH_VIEW_MODULES = {
    "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.rope": (
        ("device=torch.cuda.current_device()",),
        "Qwen3-VL's multimodal RoPE inv_freq placed on torch.cuda.current_device()",
    ),
    "megatron.bridge.models.qwen_vl.modelling_qwen3_vl.utils": (
        ("device=torch.cuda.current_device()",),
        "Qwen3-VL's vision RoPE inv_freq placed on torch.cuda.current_device()",
    ),
}
_BRIDGE_APPLIED: set = set()


def bridge_patches(prefix: str) -> list:
    """The :class:`Patch` es of :data:`BRIDGE_TORCH_VIEW_MODULES` whose module starts with
    ``prefix``."""
    return [
        Patch("torch_view:" + module.rsplit(".", 1)[-1], module, "torch_view", expect=s, why=w)
        for module, (s, w) in BRIDGE_TORCH_VIEW_MODULES.items()
        if module.startswith(prefix)
    ]


def apply_bridge_patches(prefix: str) -> bool:
    """Check and apply (once per module) the CPU patches of the Megatron-Bridge modules under
    ``prefix`` (e.g. ``"megatron.bridge.models.qwen_vl.modelling_qwen3_vl"``), when the CPU
    patches are needed; :func:`apply` first. Returns whether they are in effect."""
    if not apply():
        return False
    patches = [p for p in bridge_patches(prefix) if p.module not in _BRIDGE_APPLIED]
    probs = check_targets(patches) if patches else []
    if probs:
        raise CompatError("Megatron-Bridge CPU patches no longer match:\n  " + "\n  ".join(probs))
    for p in patches:
        p.apply()
        _BRIDGE_APPLIED.add(p.module)
    return True


def install_te_placeholder() -> bool:
    """Check and install the scoped TransformerEngine placeholder alone (on any machine, GPU
    included; :func:`apply` installs it with the CPU patches). Returns whether it is installed
    (False when TE is importable); raises :class:`CompatError` when an importer changed."""
    patches = [p for p in PATCHES if p.kind == "te_placeholder"]
    probs = check_targets(patches)
    if probs:
        raise CompatError(
            "TransformerEngine placeholder no longer matches:\n  " + "\n  ".join(probs)
        )
    return te_placeholder.install()


def apply(force: bool = False) -> bool:
    """Apply all CPU patches (once). Returns True when patches are in effect.

    Raises :class:`CompatError` when the installed megatron-core is not the pinned release or
    any patched code has changed, listing every mismatch."""
    global _APPLIED
    if _APPLIED:
        return True
    if not (force or needed()):
        return False
    # the distribution's version: megatron-core 0.19's ``__version__`` appends the short hash
    # of whatever git repository holds site-packages (a .venv inside a checkout: ours)
    from importlib.metadata import version as dist_version

    version = dist_version("megatron-core")
    probs = (
        []
        if version == MEGATRON_CORE_VERSION
        else [
            f"megatron-core {version} installed; these CPU patches target {MEGATRON_CORE_VERSION}"
        ]
    )
    probs += check_targets()
    if probs:
        raise CompatError(
            "megatron-core CPU compatibility patches no longer match:\n  " + "\n  ".join(probs)
        )
    for p in PATCHES:
        p.apply()
    _APPLIED = True
    return True
