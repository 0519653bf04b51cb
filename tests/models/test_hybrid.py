"""The hybrid family's GatedDeltaNet (models/hybrid.py): the chunked delta rule equals the token-by-token recurrence
(outputs, final state and gradients, fp64), and a mixer run in pieces that pass their recurrent state equals one run
over the whole sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longstraw_agents.models.base import MixerInput
from longstraw_agents.models.hybrid import GatedDeltaNetMixer, chunk_gated_delta_rule, l2norm
from longstraw_agents.models.presets import tiny_model


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """The definition, one position at a time: decay, read, correct by the delta rule, write, then query."""
    dk = k.shape[-1]
    q, k = l2norm(q) * dk**-0.5, l2norm(k)
    outs = []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        read = (state * k[t][:, :, None]).sum(dim=1)  # [H, Dv]: S^T k
        delta = (v[t] - read) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        outs.append((state * q[t][:, :, None]).sum(dim=1))
    return torch.stack(outs), state


def random_inputs(n: int, heads: int = 3, dk: int = 5, dv: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g = -F.softplus(rand(n, heads))  # log decays <= 0
    beta = torch.sigmoid(rand(n, heads))
    inputs = [rand(n, heads, dk), rand(n, heads, dk), rand(n, heads, dv), g, beta, 0.3 * rand(heads, dk, dv)]
    return [t.requires_grad_(True) for t in inputs]


@pytest.mark.parametrize("n", [1, 7, 64, 150])
def test_chunked_delta_rule_equals_the_recurrence_with_gradients(n: int) -> None:
    inputs = random_inputs(n)
    out, state = chunk_gated_delta_rule(*inputs, chunk=16)
    ref_out, ref_state = recurrent_gated_delta_rule(*inputs)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(out), torch.randn_like(state)
    grads = torch.autograd.grad((out * weights[0]).sum() + (state * weights[1]).sum(), inputs)
    ref_grads = torch.autograd.grad((ref_out * weights[0]).sum() + (ref_state * weights[1]).sum(), inputs)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_no_initial_state_is_a_zero_state() -> None:
    *inputs, initial = random_inputs(20)
    out, state = chunk_gated_delta_rule(*inputs, None)
    ref_out, ref_state = chunk_gated_delta_rule(*inputs, torch.zeros_like(initial))
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(state, ref_state, rtol=0, atol=0)


def test_a_mixer_run_in_pieces_equals_one_run() -> None:
    model = tiny_model("qwen3_5", dtype=torch.float64)
    layer = model.model.layers[0]
    assert layer.block_type == "linear_attention"
    mixer = GatedDeltaNetMixer(layer.linear_attn)
    x = torch.randn(23, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(23)
    rope = (torch.empty(0), torch.empty(0))  # GatedDeltaNet has no rotary embedding
    whole = mixer.forward(MixerInput(x, positions, rope))
    first = mixer.forward(MixerInput(x[:10], positions[:10], rope))
    second = mixer.forward(MixerInput(x[10:], positions[10:], rope, recurrent=first.new))
    torch.testing.assert_close(torch.cat([first.y, second.y]), whole.y, rtol=1e-10, atol=1e-10)
    for piecewise, once in zip(second.new, whole.new, strict=True):  # conv tail and delta-rule state
        torch.testing.assert_close(piecewise, once, rtol=1e-10, atol=1e-10)
    assert [tuple(t.shape) for t in whole.new] == [tuple(s) for s in mixer.state_shapes()]
