"""The CPU Mamba-2 kernels (areal_mega/compat/mamba_cpu.py) against transformers' torch
implementation of the Nemotron-H mixer, packed sequences included, forward and backward; and
megatron-core's MambaMixer, built with the CPU patches, against the same layer."""

import json
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

from areal_mega.compat import mamba_cpu
from tests.helpers.workers import ROOT, worker_cmd, worker_env

nemotron_h = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig  # noqa: E402

LENGTHS = [70, 5, 130, 1]  # across chunk boundaries (32), a sequence starting mid-chunk, one token
CHUNK = 32


def _mixer(seed=0, groups=2, chunk_size=256):
    """transformers' Nemotron-H mixer with every parameter random (dt_bias, A_log, D, the
    norm's gain, the conv bias), so that each one changes the output. Its chunk size is one
    chunk per test sequence: its state passing between chunks is wrong (see
    test_transformers_nemotron_h_multi_chunk_defect); the kernels run several (CHUNK)."""
    cfg = NemotronHConfig(
        hidden_size=24,
        mamba_num_heads=4,
        mamba_head_dim=8,
        n_groups=groups,
        ssm_state_size=6,
        conv_kernel=4,
        chunk_size=chunk_size,
        use_conv_bias=True,
        use_bias=False,
        use_mamba_kernels=False,
        layer_norm_epsilon=1e-5,
        # transformers' torch path clamps dt at time_step_min; its CUDA path and mamba-ssm's
        # kernels (megatron) use time_step_limit = (0, inf): no clamp on either side here
        time_step_min=0.0,
    )
    torch.manual_seed(seed)
    mixer = nemotron_h.NemotronHMamba2Mixer(cfg, layer_idx=0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
        mixer.norm.weight.add_(1.0)
        mixer.A_log.copy_(torch.rand_like(mixer.A_log) * 2 - 1)
    return mixer


def _bounds():
    cu = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None]
    return list(zip(cu[:-1], cu[1:])), seq_idx.to(torch.int32)


def _ours(mixer, h, seq_idx, gated_norm_inside=False):
    """The mixer's forward through the fused kernel, as megatron's MambaMixer calls it (gate
    inside the scan, then the group RMSNorm) or with the gated norm inside the kernel."""
    zxbcdt = mixer.in_proj(h)
    kwargs = dict(
        chunk_size=CHUNK,
        seq_idx=seq_idx,
        activation="silu",
        headdim=mixer.head_dim,
        ngroups=mixer.n_groups,
        norm_before_gate=False,
    )
    args = (
        zxbcdt,
        mixer.conv1d.weight[:, 0],
        mixer.conv1d.bias,
        mixer.dt_bias,
        -torch.exp(mixer.A_log.float()),
        mixer.D,
    )
    if gated_norm_inside:
        y = mamba_cpu.mamba_split_conv1d_scan_combined(
            *args,
            rmsnorm_weight=mixer.norm.weight,
            rmsnorm_eps=mixer.norm.variance_epsilon,
            **kwargs,
        )
    else:
        y = mamba_cpu.mamba_split_conv1d_scan_combined(*args, **kwargs)
        norm = mamba_cpu.RMSNormGated(
            y.shape[-1],
            eps=mixer.norm.variance_epsilon,
            group_size=mixer.norm.group_size,
            norm_before_gate=False,
        )
        norm.weight = mixer.norm.weight  # shared: its gradient is compared too
        y = norm(y)
    return mixer.out_proj(y)


def _close(got, want, rel=1e-5):
    got, want = got.detach(), want.detach()
    assert float((got - want).abs().max()) <= rel * float(want.abs().max()), (
        float((got - want).abs().max()),
        float(want.abs().max()),
    )


@pytest.mark.parametrize("gated_norm_inside", [False, True])
def test_packed_mixer_equals_transformers_per_sequence(gated_norm_inside):
    mixer = _mixer()
    bounds, seq_idx = _bounds()
    h = torch.randn(1, sum(LENGTHS), 24, requires_grad=True)
    got = _ours(mixer, h, seq_idx, gated_norm_inside)
    params = list(mixer.parameters())
    dy = torch.randn_like(got)
    got_grads = torch.autograd.grad((got * dy).sum(), [h, *params])
    want = torch.cat([mixer.torch_forward(h[:, s:e]) for s, e in bounds], dim=1)
    want_grads = torch.autograd.grad((want * dy).sum(), [h, *params])
    _close(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.isfinite(a).all()
        _close(a, b)


def test_packing_changes_the_result():
    """Without seq_idx the state runs on from one sequence into the next: the packed case
    above is not passing by accident."""
    mixer = _mixer(seed=1)
    bounds, seq_idx = _bounds()
    h = torch.randn(1, sum(LENGTHS), 24)
    with torch.no_grad():
        packed, joined = _ours(mixer, h, seq_idx), _ours(mixer, h, None)
        s, e = bounds[1]
        assert float((packed[:, s:e] - joined[:, s:e]).abs().max()) > 1e-2
        _close(joined, mixer.torch_forward(h))


def test_scan_final_state_and_batch():
    torch.manual_seed(2)
    b, length, h, p, g, n = 2, 45, 4, 3, 1, 5
    x, z = torch.randn(b, length, h, p), torch.randn(b, length, h, p)
    dt, A, dt_bias = torch.randn(b, length, h), -torch.rand(h) - 0.1, torch.randn(h)
    B, C = torch.randn(b, length, g, n), torch.randn(b, length, g, n)
    D = torch.randn(h, p)
    y, final = mamba_cpu.mamba_chunk_scan_combined(
        x,
        dt,
        A,
        B,
        C,
        16,
        D=D,
        z=z,
        dt_bias=dt_bias,
        dt_softplus=True,
        dt_limit=(0.05, 2.0),
        return_final_states=True,
    )
    # the plain recurrence, one position at a time
    dtf = F.softplus(dt + dt_bias).clamp(0.05, 2.0)
    state, ys = torch.zeros(b, h, p, n), []
    for t in range(length):
        decay = torch.exp(dtf[:, t] * A)[..., None, None]
        state = state * decay + dtf[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :1, None]
        ys.append((state * C[:, t, :1, None]).sum(-1) + D * x[:, t])
    want = torch.stack(ys, 1) * F.silu(z)
    _close(y, want)
    _close(final, state)


def test_packed_causal_conv_restarts_each_sequence():
    bounds, seq_idx = _bounds()
    x = torch.randn(1, 12, sum(LENGTHS))
    w, bias = torch.randn(12, 4), torch.randn(12)
    got = mamba_cpu.causal_conv1d_fn(x, w, bias, seq_idx=seq_idx, activation="silu")
    want = torch.cat(
        [
            F.silu(F.conv1d(x[..., s:e], w[:, None], bias, padding=3, groups=12))[..., : e - s]
            for s, e in bounds
        ],
        dim=-1,
    )
    _close(got, want)
    with pytest.raises(NotImplementedError, match="states"):
        mamba_cpu.causal_conv1d_fn(x, w, return_final_states=True)


def test_transformers_nemotron_h_multi_chunk_defect():
    """transformers 5.12.1's Nemotron-H torch path passes the SSM state between chunks summed
    over the wrong axis (its Mamba-2 and Falcon-H1 copies are right): past its first chunk it
    is not the recurrence. The kernels here are (test_scan_final_state_and_batch). When this
    fails, upstream fixed it: compare with a multi-chunk reference in the tests above, and drop
    the correction in areal_mega/inference/hf_corrections.py."""
    mixer, one_chunk = _mixer(chunk_size=16), _mixer(chunk_size=64)
    h = torch.randn(1, 40, 24)
    with torch.no_grad():
        right, multi = one_chunk.torch_forward(h), mixer.torch_forward(h)
        _close(multi[:, :16], right[:, :16])
        _close(_ours(mixer, h, None), right)
        assert float((multi[:, 16:] - right[:, 16:]).abs().max()) > 1e-2


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_megatron_mixer_with_the_patch_equals_transformers():
    """tests/helpers/mamba_probe_worker.py (a fresh process): megatron-core's MambaMixer lacks
    its kernels here without the patch (when it has them, the patch is no longer needed), and
    with it, on three packed sequences, equals transformers' mixer per sequence (output and
    the gradients of the input and of every parameter)."""
    out = subprocess.run(
        worker_cmd("mamba_probe_worker"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=worker_env(dict(os.environ, PYTHONWARNINGS="ignore")),
    )
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("MAMBA_PROBE ")]
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    res = json.loads(line[0][len("MAMBA_PROBE ") :])
    assert not any(res["unpatched"].values()), res["unpatched"]
    patched = res["patched"]
    assert patched.pop("bias_is_none") is True
    assert len(patched) == 8 and max(patched.values()) <= 1e-5, patched


def _causal_lm(chunk_size, time_step_min=0.001):
    """transformers' Nemotron-H causal LM (Mamba, attention and MLP layers) in fp32 with every
    weight random; some heads' dt_bias so low that dt falls under time_step_min (the clamp
    bites)."""
    cfg = NemotronHConfig(
        vocab_size=40,
        hidden_size=24,
        hybrid_override_pattern="M*M-",
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=6,
        intermediate_size=32,
        mamba_num_heads=4,
        mamba_head_dim=8,
        n_groups=2,
        ssm_state_size=6,
        conv_kernel=4,
        chunk_size=chunk_size,
        use_mamba_kernels=False,
        time_step_min=time_step_min,
    )
    torch.manual_seed(0)
    model = nemotron_h.NemotronHForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(
                1 + 0.3 * torch.randn_like(p)
                if n.endswith("norm.weight")
                else torch.rand_like(p) * 2 - 1
                if "A_log" in n
                else torch.randn_like(p) * 0.3
            )
            if n.endswith("dt_bias"):
                p[:2] = -9.0  # softplus(-9 + small) < 0.001
    return model


def test_corrected_torch_path_past_the_first_chunk():
    """areal_mega/inference/hf_corrections.py (the CPU rollout server applies it when it loads
    a Nemotron-H model): transformers' torch path with the multi-chunk scan corrected equals
    the same weights scanned as one chunk (where transformers is right), dt clamped at
    time_step_min on both; the prompt's cache (conv window, SSM state) continues into
    one-token decoding steps, which stay transformers' own, as a one-chunk forward of the
    whole sequence does. Uncorrected, the same model differs (the test bites)."""
    from areal_mega.inference.hf_corrections import correct_loaded_model

    model, one_chunk = _causal_lm(chunk_size=16), _causal_lm(chunk_size=64)
    ids = torch.randint(0, 40, (2, 43), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = one_chunk(ids, use_cache=False).logits
        wrong = model(ids[:, :40], use_cache=False).logits
        assert float((wrong - want[:, :40]).abs().max()) > 1e-2
        correct_loaded_model(model)
        _close(model(ids[:, :40], use_cache=False).logits, want[:, :40])
        out = model(ids[:, :40], use_cache=True)
        steps, cache = [out.logits[:, -1]], out.past_key_values
        for t in range(40, 43):
            out = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            steps.append(out.logits[:, -1])
            cache = out.past_key_values
    _close(torch.stack(steps, 1), want[:, 39:])


def test_the_cpu_rollout_server_loads_nemotron_h_corrected(tmp_path):
    """The CPU rollout server's model (areal_mega/inference/server_state.py) scans a prompt
    past the first chunk as one chunk would (the correction applied at loading)."""
    from areal_mega.inference.server_state import LocalRolloutServer

    _causal_lm(chunk_size=16).save_pretrained(tmp_path)
    server = LocalRolloutServer(str(tmp_path), max_running=2)
    ids = torch.randint(0, 40, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _close(
            server.model(ids, use_cache=False).logits,
            _causal_lm(chunk_size=64)(ids, use_cache=False).logits,
        )


def test_the_server_batch_keeps_mamba_states_per_row():
    """The CPU rollout server's HFCacheBatch (areal_mega/inference/kv_cache.py) on Nemotron-H:
    two prompts past the first chunk and a shorter one joined later (attention keys/values
    left-padded, Mamba states row by row), three decoding steps, then rows dropped and
    reordered: every row's logits equal a forward of its whole sequence without a cache."""
    from areal_mega.inference.hf_corrections import correct_loaded_model
    from areal_mega.inference.kv_cache import HFCacheBatch, make_kv_batch

    model = _causal_lm(chunk_size=16)
    correct_loaded_model(model)
    batch = make_kv_batch(model)
    assert isinstance(batch, HFCacheBatch)
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, 40, (2, 20), generator=g), torch.randint(0, 40, (1, 7), generator=g)
    seqs = [a[0].tolist(), a[1].tolist(), b[0].tolist()]

    def check(logits, rows):
        want = [model(torch.tensor([s]), use_cache=False).logits[0, -1] for s in rows]
        _close(logits, torch.stack(want))

    with torch.no_grad():
        logits, kv = batch.prefill(a)
        batch.append(kv, [0, 1])
        check(logits, seqs[:2])
        logits, kv = batch.prefill(b)
        batch.append(kv, [0])
        for _ in range(3):
            toks = torch.randint(0, 40, (len(seqs),), generator=g).tolist()
            seqs = [s + [t] for s, t in zip(seqs, toks)]
            check(batch.decode(toks), seqs)
        batch.select([2, 0])
        seqs = [seqs[2] + [1], seqs[0] + [2]]
        check(batch.decode([1, 2]), seqs)
