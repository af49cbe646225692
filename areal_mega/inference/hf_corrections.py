"""Corrections of the installed transformers' modelling code that the CPU rollout server needs,
applied to a loaded model by :func:`correct_loaded_model`.

* Nemotron-H (transformers 5.12.1): the torch path of ``NemotronHMamba2Mixer``
  (``torch_forward``, what runs without the CUDA kernels) passes the SSM state from chunk to
  chunk summed over the wrong axis (over the receiving chunks instead of the sending ones), so
  past its first ``chunk_size`` positions (128 in real checkpoints) its output is not the
  recurrence; its CUDA path, its Mamba-2 and Falcon-H1 copies and megatron-core are right.
  Corrected: a prompt longer than one chunk is scanned with
  :func:`areal_mega.compat.mamba_cpu.mamba_chunk_scan_combined` (the CUDA path's steps: the
  same projections, convolution, cache updates and padding mask); a prompt within one chunk
  and every one-token decoding step (the plain recurrence) stay transformers' own. dt is
  clamped below at ``time_step_min`` as transformers' torch path does on both steps (its CUDA
  path and megatron-core do not clamp: a checkpoint whose dt falls below it differs from the
  trainer there). ``tests/test_mamba_cpu.py::test_transformers_nemotron_h_multi_chunk_defect``
  fails once transformers fixes it: then drop the correction.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from areal_mega.compat.mamba_cpu import mamba_chunk_scan_combined

__all__ = ["correct_loaded_model", "correct_nemotron_h_scan"]


def _nemotron_h_forward(self, input_states, cache_params=None, attention_mask=None):
    """``NemotronHMamba2Mixer.torch_forward`` with the multi-chunk scan corrected."""
    cls_forward = type(self).torch_forward
    length = input_states.shape[1]
    if length <= self.chunk_size or (
        cache_params is not None and cache_params.has_previous_state(self.layer_idx)
    ):
        return cls_forward(self, input_states, cache_params, attention_mask)
    dtype, batch = input_states.dtype, input_states.shape[0]
    if attention_mask is not None:
        input_states = (input_states * attention_mask[:, :, None]).to(dtype)
    proj = self.in_proj(input_states)
    gn = self.n_groups * self.ssm_state_size
    d_mlp = (proj.shape[-1] - 2 * self.intermediate_size - 2 * gn - self.num_heads) // 2
    _, _, gate, xbc, dt = proj.split(
        [d_mlp, d_mlp, self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
    )
    xbc = xbc.transpose(1, 2)
    if cache_params is not None:  # the last conv_kernel inputs, as transformers keeps them
        window = F.pad(xbc, (self.conv_kernel_size - xbc.shape[-1], 0))
        cache_params.update_conv_state(window, self.layer_idx)
    xbc = self.act(self.conv1d(xbc)[..., :length].transpose(1, 2))
    if attention_mask is not None:
        xbc = (xbc * attention_mask[:, :, None]).to(xbc.dtype)
    x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
    y, state = mamba_chunk_scan_combined(
        x.reshape(batch, length, -1, self.head_dim),
        dt,
        -torch.exp(self.A_log.float()),
        B.reshape(batch, length, self.n_groups, -1),
        C.reshape(batch, length, self.n_groups, -1),
        chunk_size=self.chunk_size,
        D=self.D,
        dt_bias=self.dt_bias,
        dt_softplus=True,
        dt_limit=(float(self.time_step_min), float("inf")),
        return_final_states=True,
    )
    if cache_params is not None:
        cache_params.update_recurrent_state(state, self.layer_idx)
    y = self.norm(y.reshape(batch, length, -1), gate)
    return self.out_proj(y.to(dtype))


def correct_nemotron_h_scan(model) -> int:
    """Give every Nemotron-H Mamba-2 mixer of ``model`` the corrected torch path (see the
    module docstring); returns how many mixers were corrected."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    n = 0
    for module in model.modules():
        if isinstance(module, NemotronHMamba2Mixer):
            module.torch_forward = types.MethodType(_nemotron_h_forward, module)
            n += 1
    return n


def correct_loaded_model(model) -> None:
    """Apply the corrections this module lists that concern ``model``'s family."""
    if getattr(model.config, "model_type", None) == "nemotron_h":
        correct_nemotron_h_scan(model)
