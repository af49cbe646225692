"""LoRA checks in real gloo processes, run by tests/test_lora_layouts.py and
tests/test_lora_peft_interop.py.

    python -m tests.helpers.lora_worker <scenario> <rank> <world> <port> <out_dir>

Everything goes through production code: the tiny HF model is converted once
(``convert_hf_to_mcore``) and each engine loads its base from that checkpoint like a training
run (``load_checkpoint(..., model_keys=base_keys)``), its adapters from a PEFT directory
(``load_peft_adapter``). Gradients and updated adapters are compared under their PEFT names
(``iter_peft_tensors``, TP shards gathered), so every layout is compared with the single-rank
reference tensor for tensor. Rank r writes ``<out_dir>/<scenario>.<r>.json``.
"""

import json
import os
import sys
import traceback

import torch

from tests.helpers.engine_worker import POLICY, TEMP, attach_policy_inputs, losses

RANK8 = dict(rank=8, alpha=16.0)
MESH = [None]


def set_mesh(sp=False, vpp=None, **dims):
    from areal_mega.parallel.allocation import ParallelDims
    from areal_mega.parallel.mesh import ParallelMesh

    if MESH[0] is not None:
        MESH[0].destroy()
    MESH[0] = ParallelMesh.create(
        ParallelDims(**dims), sequence_parallel=sp, vpp=vpp, timeout_s=120
    )
    return MESH[0]


def lora_cfg(targets=None, **kw):
    from areal_mega.config import LoraConfig

    cfg = LoraConfig(enabled=True, **{**RANK8, **kw})
    if targets is not None:
        cfg.target_modules = list(targets)
    return cfg


def engine(hf_dir, base_ckpt, lora, *, lr=1e-3, distopt=False):
    """A LoRA actor on the current mesh with its base loaded from ``base_ckpt``."""
    from areal_mega.checkpoint.dist_ckpt import load_checkpoint
    from areal_mega.config import ModelConfig, OptimizerConfig
    from areal_mega.engine import MegatronEngine
    from areal_mega.lora.actor import base_keys

    # Adam's first step is lr·g/(|g|+eps): with the default eps a gradient near 1e-8 differing
    # by rounding moves its weight by up to lr, so the layouts compare under eps=1e-4
    eng = MegatronEngine(
        ModelConfig(path=str(hf_dir), dtype="fp32"),
        role="actor",
        mesh=MESH[0],
        optimizer_cfg=OptimizerConfig(lr=lr, clip_grad=0.0, eps=1e-4),
        seed=7,
        use_distributed_optimizer=distopt,
        lora=lora,
    )
    load_checkpoint(
        base_ckpt, eng.model_chunks(), load_optimizer=False, load_rng=False, model_keys=base_keys
    )
    return eng


def randomize_adapters(eng, seed):
    """Give every adapter non-zero A and B (full shapes, TP1 only: the reference)."""
    g = torch.Generator().manual_seed(seed)
    for c in eng.model_chunks():
        for n, p in sorted(c.named_parameters()):
            if ".adapter." in n:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def peft_tensors(eng, grads=False):
    from areal_mega.lora.peft_io import iter_peft_tensors

    return dict(iter_peft_tensors(eng.model, eng.arch, rank=eng.lora.rank, grads=grads))


def publish(eng, out):
    from areal_mega.lora.actor import publish_adapter

    return publish_adapter(eng, out, base_model="tiny", is_writer=MESH[0].rank == 0)


def worst(a: dict, b: dict) -> float:
    """Max abs difference over the names of ``a`` (this rank's stage), all present in ``b``."""
    assert a and set(a) <= set(b), sorted(set(a) - set(b))[:3]
    return max((a[k] - b[k]).abs().max().item() for k in a)


def make_data(seed, pad=2, vocab=100):
    """Packed micro-batches of random sequences (ids below the tiny models' vocabulary)."""
    from areal_mega.scheduler.packing import pack_sequences
    from areal_mega.train.batches import next_token_layout

    g = torch.Generator().manual_seed(seed)
    mbs = []
    for lens in ([9, 14, 5], [20, 3], [6, 6, 6, 4], [17]):
        seqs = [
            {
                "input_ids": torch.randint(0, vocab, (n,), generator=g),
                "prompt_len": max(1, n // 3),
                "advantages": torch.randn(1, generator=g).expand(n).clone(),
            }
            for n in lens
        ]
        mbs.append(
            pack_sequences(
                [{**s, **next_token_layout(s["input_ids"])} for s in seqs], pad_to_multiple=pad
            )
        )
    return mbs


MODELS = {
    "qwen3": dict(head_dim=16),
    "qwen3_moe": dict(head_dim=16),
    "llama": dict(num_layers=4),
}  # 4 layers: PP2 x VPP2


def model_paths(tmp, arch):
    return os.path.join(tmp, f"hf_{arch}"), os.path.join(tmp, f"mcore_{arch}")


def scenario_prepare(res, tmp, archs=None):
    """Tiny HF models and their converted checkpoints (the converter runs on one rank)."""
    from areal_mega.checkpoint.convert import convert_hf_to_mcore
    from areal_mega.models.tiny import make_tiny_model

    for arch, spec in MODELS.items():
        if archs is not None and arch not in archs:
            continue
        hf, ckpt = model_paths(tmp, arch)
        make_tiny_model(hf, arch=arch, tie_word_embeddings=False, **spec)
        convert_hf_to_mcore(hf, ckpt, progress=False)
        res[arch] = 1.0


def train_once(eng, mbs):
    stats = eng.forward_backward(mbs, *losses(POLICY), temperature=TEMP, return_entropy=True)
    grads = peft_tensors(eng, grads=True)
    eng.optimizer_step()
    return stats, grads, peft_tensors(eng)


def reference(hf, ckpt, lora, mbs, tmp, tag):
    """TP1 LoRA actor on the DP mesh (every rank runs every micro-batch): logprobs, PEFT-named
    grads and adapters after one step; its adapters before the step go to ``<tmp>/<tag>``."""
    eng = engine(hf, ckpt, lora)
    randomize_adapters(eng, 5)
    adapter_dir = publish(eng, os.path.join(tmp, tag))
    lps = eng.forward_logprobs(mbs, temperature=TEMP)
    for i, (mb, lp) in enumerate(zip(mbs, lps)):
        attach_policy_inputs(mb, lp, 100 + i)
    stats, grads, after = train_once(eng, mbs)
    return dict(dir=adapter_dir, lps=lps, grads=grads, after=after, loss=stats["loss"])


def check(res, tag, ref, hf, ckpt, lora, my_mbs, my_lps, distopt=False):
    from areal_mega.lora.peft_io import load_peft_adapter

    m = MESH[0]
    eng = engine(hf, ckpt, lora, distopt=distopt)
    load_peft_adapter(
        eng.model, eng.arch, ref["dir"], rank=lora.rank, tp_rank=m.tp_rank, tp=m.dims.tp
    )
    got = eng.forward_logprobs(my_mbs, temperature=TEMP)
    res[f"{tag}.logprobs"] = max((a - b).abs().max().item() for a, b in zip(got, my_lps))
    stats, grads, after = train_once(eng, my_mbs)
    if not distopt:  # the distributed optimizer's main_grad holds its own shard only
        res[f"{tag}.grads"] = worst(grads, ref["grads"])
    res[f"{tag}.loss"] = abs(stats["loss"] - ref["loss"])
    res[f"{tag}.step"] = worst(after, ref["after"])
    opt_params = sum(p.numel() for g in eng.optimizer.param_groups for p in g["params"])
    trainable = sum(
        p.numel() for c in eng.model_chunks() for p in c.parameters() if p.requires_grad
    )
    res[f"{tag}.only_adapters_train"] = float(
        trainable == eng.lora.n_trainable
        and (distopt or opt_params == trainable)
        and all(
            ".adapter." in n
            for c in eng.model_chunks()
            for n, p in c.named_parameters()
            if p.requires_grad
        )
    )
    return eng


def scenario_layouts(res, tmp):
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    set_mesh(dp=world)
    hf, ckpt = model_paths(tmp, "qwen3")
    lora = lora_cfg()
    mbs = make_data(1, pad=1)  # odd packed lengths (TP without SP does not pad)
    ref = reference(hf, ckpt, lora, mbs, tmp, "ref_dense")
    half = slice(rank, None, world)
    check(res, "dp2", ref, hf, ckpt, lora, mbs[half], ref["lps"][half])
    check(res, "dp2_distopt", ref, hf, ckpt, lora, mbs[half], ref["lps"][half], distopt=True)
    sp_mbs = make_data(1, pad=world)
    ref_sp = reference(hf, ckpt, lora, sp_mbs, tmp, "ref_sp")
    set_mesh(tp=world)
    eng = check(res, "tp2", ref, hf, ckpt, lora, mbs, ref["lps"])
    saved_tp2 = os.path.join(tmp, "ckpt_tp2")
    eng.save(saved_tp2)  # adapters + Adam after the step, resumed at TP1 below
    del eng
    set_mesh(tp=world, sp=True)
    check(res, "tp2sp", ref_sp, hf, ckpt, lora, sp_mbs, ref_sp["lps"])
    set_mesh(dp=world)
    eng = engine(hf, ckpt, lora)
    eng.load(saved_tp2)
    res["ckpt_tp2_to_tp1"] = worst(peft_tensors(eng), ref["after"])
    del eng
    set_mesh(pp=world)
    check(res, "pp2", ref, hf, ckpt, lora, mbs, ref["lps"])
    # a subset of the projections (the bridge's own fused wrappers need all of q/k/v)
    set_mesh(dp=world)
    sub = lora_cfg(["q_proj", "v_proj", "up_proj", "down_proj"])
    ref_sub = reference(hf, ckpt, sub, mbs, tmp, "ref_subset")  # on the d2 mesh
    set_mesh(tp=world)
    check(res, "tp2_subset", ref_sub, hf, ckpt, sub, mbs, ref_sub["lps"])
    # the interleaved pipeline: PP2 x VPP2 over a 4-layer model
    set_mesh(dp=world)
    hf4, ckpt4 = model_paths(tmp, "llama")
    ref_vpp = reference(hf4, ckpt4, lora, mbs, tmp, "ref_vpp")
    set_mesh(pp=world, vpp=2)
    check(res, "pp2vpp2", ref_vpp, hf4, ckpt4, lora, mbs, ref_vpp["lps"])
    scenario_moe(res, tmp)


def scenario_moe(res, tmp):
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    set_mesh(dp=world)
    hf, ckpt = model_paths(tmp, "qwen3_moe")
    lora = lora_cfg(["q_proj", "k_proj", "v_proj", "o_proj"])
    mbs = make_data(2)
    ref = reference(hf, ckpt, lora, mbs, tmp, "ref_moe")
    half = slice(rank, None, world)
    set_mesh(dp=world, ep=world)
    check(res, "ep2", ref, hf, ckpt, lora, mbs[half], ref["lps"][half])


def hf_logprobs(model, mbs):
    """Per-token logprobs of the HF (or PEFT) ``model`` on each sequence of ``mbs`` alone, laid
    out like ``forward_logprobs`` (the next token's logprob; 0 at each sequence's end)."""
    outs = []
    with torch.no_grad():
        for mb in mbs:
            ids = mb["input_ids"].long()
            lp = torch.zeros(ids.numel())
            for b in range(len(mb["seqlens"])):
                s, n = int(mb["cu_seqlens"][b]), int(mb["seqlens"][b])
                seq = ids[s : s + n]
                logits = model(input_ids=seq[None]).logits[0].float() / TEMP
                lp[s : s + n - 1] = torch.log_softmax(logits[:-1], -1).gather(-1, seq[1:, None])[
                    :, 0
                ]
            outs.append(lp)
    return outs


def max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def scenario_interop(res, tmp):  # noqa: C901 (one story, read top to bottom)
    """One rank: our adapters in PEFT's hands and PEFT's adapters in ours."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from areal_mega.lora.actor import AdaptersOffReference, merged_deltas
    from areal_mega.lora.peft_io import load_peft_adapter
    from areal_mega.train.weights import export_hf_dir

    set_mesh()
    hf, ckpt = model_paths(tmp, "qwen3")
    mbs = make_data(3, pad=1)
    load = lambda p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()  # noqa
    eng = engine(hf, ckpt, lora_cfg())
    randomize_adapters(eng, 9)
    ours = publish(eng, os.path.join(tmp, "ours"))
    lps = eng.forward_logprobs(mbs, temperature=TEMP)
    res["ours_in_peft"] = max_diff(lps, hf_logprobs(PeftModel.from_pretrained(load(hf), ours), mbs))
    off = AdaptersOffReference(eng).forward_logprobs(mbs, temperature=TEMP)
    res["adapters_off_is_base"] = max_diff(off, hf_logprobs(load(hf), mbs))
    res["adapters_change_output"] = max_diff(off, lps)
    merged = export_hf_dir(
        eng, hf, os.path.join(tmp, "merged"), is_writer=True, deltas=merged_deltas(eng)
    )
    res["merged_export"] = max_diff(lps, hf_logprobs(load(merged), mbs))
    # an adapter made by peft itself (a subset of the projections), loaded into our engine
    g = torch.Generator().manual_seed(4)
    pm = get_peft_model(
        load(hf),
        LoraConfig(
            r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]
        ),
    )
    for n, p in sorted(pm.named_parameters()):
        if "lora_" in n:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(os.path.join(tmp, "theirs"))
    eng2 = engine(hf, ckpt, lora_cfg(["q_proj", "v_proj", "down_proj"]))
    names = load_peft_adapter(
        eng2.model, eng2.arch, os.path.join(tmp, "theirs"), rank=8, tp_rank=0, tp=1
    )
    res["peft_tensors_loaded"] = float(len(names))
    from areal_mega.lora.peft_io import PeftFormatError

    narrow = engine(hf, ckpt, lora_cfg(["q_proj", "v_proj"]))  # no place for down_proj
    try:
        load_peft_adapter(
            narrow.model, narrow.arch, os.path.join(tmp, "theirs"), rank=8, tp_rank=0, tp=1
        )
        res["extra_tensors_refused"] = 0.0
    except PeftFormatError as e:
        res["extra_tensors_refused"] = float("down_proj" in str(e) and "4 tensors" in str(e))
    del narrow
    res["theirs_in_ours"] = max_diff(
        eng2.forward_logprobs(mbs, temperature=TEMP), hf_logprobs(pm.eval(), mbs)
    )
    # an adapter-only checkpoint after a step: small, and a resumed step equals the original
    for i, (mb, lp) in enumerate(zip(mbs, lps)):
        attach_policy_inputs(mb, lp, 200 + i)
    train_once(eng, mbs)
    eng.save(os.path.join(tmp, "ckpt_lora"))
    res["ckpt_bytes"] = float(dir_bytes(os.path.join(tmp, "ckpt_lora")))
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(os.path.join(tmp, "ckpt_lora", "iter_0000001")).read_metadata()
    model_keys = [
        k
        for k in saved.state_dict_metadata
        if k.startswith(("decoder.", "embedding.", "output_layer."))
    ]
    res["ckpt_model_keys"] = float(len(model_keys))
    res["ckpt_base_keys"] = float(sum(".adapter." not in k for k in model_keys))
    res["base_ckpt_bytes"] = float(dir_bytes(ckpt))
    res["peft_bytes"] = float(dir_bytes(ours))
    eng3 = engine(hf, ckpt, lora_cfg())
    eng3.load(os.path.join(tmp, "ckpt_lora"))
    _, _, after_orig = train_once(eng, mbs)
    _, _, after_resumed = train_once(eng3, mbs)
    res["resumed_step"] = worst(after_resumed, after_orig)
    res["resumed_step_count"] = float(eng3.step_count == eng.step_count == 2)


def scenario_prepared_interop(res, tmp):
    """The qwen3 model made and converted, then :func:`scenario_interop`, in one process
    (as a trainer converts, then trains)."""
    scenario_prepare(res, tmp, ["qwen3"])
    scenario_interop(res, tmp)


SCENARIOS = {
    "prepare": scenario_prepare,
    "layouts": scenario_layouts,
    "prepared_interop": scenario_prepared_interop,
}


def main():
    scenario, rank, world, port, out_dir = sys.argv[1:6]
    os.environ.update(
        RANK=rank, WORLD_SIZE=world, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_RANK=rank
    )
    torch.set_num_threads(1)
    res: dict = {}
    try:
        SCENARIOS[scenario](res, out_dir)
    except Exception:
        res = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"{scenario}.{rank}.json"), "w") as f:
        json.dump(res, f)
    if MESH[0] is not None:
        MESH[0].destroy()


if __name__ == "__main__":
    main()
