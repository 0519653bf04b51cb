"""The hybrid family's GatedDeltaNet (models/hybrid.py, models/delta_rule.py): the chunked delta rule equals the
token-by-token recurrence (outputs, final state and gradients, fp64), a mixer run in pieces that pass their recurrent
state equals one run over the whole sequence, and on CUDA the kernels a layer runs (flash-linear-attention's forward
where no gradient flows, the Triton scan under autograd) equal the pure-torch chunked delta rule."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from longstraw_agents.models import delta_rule, hybrid
from longstraw_agents.models.base import MixerInput
from longstraw_agents.models.delta_rule import chunk_gated_delta_rule, l2norm
from longstraw_agents.models.hybrid import GatedDeltaNetMixer
from longstraw_agents.models.presets import build_model, tiny_model, tiny_qwen3_5


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


def test_a_chunks_new_state_holds_no_chunk_sized_storage() -> None:
    """The conv tail a mixer returns owns its (K-1) rows: a view of the chunk's conv input would keep that whole
    input alive while a capture holds every layer's new entries until the chunk is recorded (about 4 GB for
    Qwen3.6-27B's 48 GatedDeltaNet layers at 4,096-token chunks)."""
    model = tiny_model("qwen3_5", dtype=torch.float64)
    mixer = GatedDeltaNetMixer(model.model.layers[0].linear_attn)
    x = torch.randn(64, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    rope = (torch.empty(0), torch.empty(0))
    with torch.no_grad():
        new = mixer.state_entries(MixerInput(x, torch.arange(64), rope))
    for t in new:
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def run_in_two_pieces(mixer: GatedDeltaNetMixer, x: torch.Tensor, split: int, initial: tuple[torch.Tensor, ...]):
    """The mixer over ``x[:split]`` from ``initial`` (conv tail, delta-rule state), then over the rest from there."""
    positions = torch.arange(x.shape[0], device=x.device)
    rope = (torch.empty(0), torch.empty(0))  # GatedDeltaNet has no rotary embedding
    first = mixer.forward(MixerInput(x[:split], positions[:split], rope, recurrent=initial))
    second = mixer.forward(MixerInput(x[split:], positions[split:], rope, recurrent=first.new))
    return torch.cat([first.y, second.y]), *second.new


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def cuda_layer(dtype: torch.dtype, n: int) -> tuple[GatedDeltaNetMixer, torch.Tensor, tuple[torch.Tensor, ...]]:
    """A GatedDeltaNet layer with Qwen3.6's head sizes (fla's tiles) on the GPU, ``n`` random inputs and a random
    initial state (conv tail in the model's dtype, delta-rule state in the compute dtype); leaves of the graph in
    fp32."""
    config = tiny_qwen3_5(hidden=128)
    config.linear_key_head_dim = config.linear_value_head_dim = 128
    model = build_model(config, dtype=dtype).cuda()
    mixer = GatedDeltaNetMixer(model.model.layers[0].linear_attn)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, config.hidden_size, generator=gen).to("cuda", dtype)
    tail_shape, state_shape = mixer.state_shapes()
    initial = (
        (0.3 * torch.randn(tail_shape, generator=gen)).to("cuda", dtype),
        torch.randn(state_shape, generator=gen).cuda(),
    )
    grads = dtype == torch.float32
    return mixer, x.requires_grad_(grads), tuple(t.requires_grad_(grads) for t in initial)


def compare_with_the_torch_scan(mixer, x, initial, monkeypatch: pytest.MonkeyPatch, gradients: bool) -> None:
    """A GatedDeltaNet layer run as ``delta_rule`` chooses on the GPU, then with the pure-torch scan: outputs and
    final states, and with ``gradients`` those of the input, the initial state and the mixer's weights. Both run the
    delta rule in fp32 (the compute dtype); fla's products may use TF32, hence per-mille tolerances."""
    mod = mixer.mod
    names = ["x", "tail", "state", "in_proj_qkv", "in_proj_a", "A_log", "dt_bias"]
    wrt = [x, *initial, mod.in_proj_qkv.weight, mod.in_proj_a.weight, mod.A_log, mod.dt_bias]

    def run() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        with torch.set_grad_enabled(gradients):
            outputs = list(run_in_two_pieces(mixer, x, 70, initial))  # 70 + 80 positions: partial blocks of 64
        if not gradients:
            return outputs, []
        probes = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(t) for i, t in enumerate(outputs)]
        loss = sum((t * probe).sum() for t, probe in zip(outputs, probes, strict=True))
        return outputs, list(torch.autograd.grad(loss, wrt))

    (y, tail, state), kernel_grads = run()
    monkeypatch.setenv(delta_rule.CHOICE_ENV, "torch")
    (want_y, want_tail, want_state), fallback_grads = run()
    torch.testing.assert_close(tail, want_tail, rtol=0, atol=0)  # the conv tail does not go through the kernel
    tolerance = 5e-3 if x.dtype == torch.float32 else 2e-2
    assert relative_error(y, want_y) < tolerance
    assert relative_error(state, want_state) < tolerance
    assert len(kernel_grads) == len(fallback_grads) == (len(names) if gradients else 0)
    for name, got, want in zip(names, kernel_grads, fallback_grads, strict=False):
        assert relative_error(got, want) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fla_forward_equals_the_torch_scan_where_no_gradient_flows(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    if delta_rule.fla_forward(torch.device("cuda")) is None:
        pytest.skip("flash-linear-attention is not installed, or fails on this GPU (a warning says why)")
    fla, calls = delta_rule.fla_forward(torch.device("cuda")), []

    def spy(*args, **kwargs):
        calls.append(1)
        return fla(*args, **kwargs)

    monkeypatch.setattr(delta_rule, "fla_forward", lambda device: spy)
    mixer, x, initial = cuda_layer(dtype, 150)
    compare_with_the_torch_scan(mixer, x.detach(), tuple(t.detach() for t in initial), monkeypatch, gradients=False)
    assert calls, "fla's forward was not used where no gradient flows"


@pytest.mark.gpu
def test_the_triton_scan_under_autograd_equals_the_torch_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under autograd a layer never calls fla (its backward is refused on Hopper under Triton < 3.7.1): the Triton
    scan runs, and equals the pure-torch scan, initial-state gradient included."""
    monkeypatch.setattr(delta_rule, "fla_forward", lambda device: pytest.fail("fla called under autograd"))
    mixer, x, initial = cuda_layer(torch.float32, 150)
    compare_with_the_torch_scan(mixer, x, initial, monkeypatch, gradients=True)


def _fake_fla(monkeypatch: pytest.MonkeyPatch, kernel) -> None:
    """Install a stand-in ``fla.ops.gated_delta_rule`` module whose kernel is ``kernel``."""
    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = kernel  # type: ignore[attr-defined]
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module)
    monkeypatch.setattr(delta_rule, "_FLA_ON", {})


def _delta_rule_like(q, k, v, g, beta, output_final_state, use_qk_l2norm_in_kernel, initial_state=None):
    return (q * k).sum(-1, keepdim=True) * v, None


def test_fla_is_used_where_its_forward_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_fla(monkeypatch, _delta_rule_like)
    assert delta_rule.fla_forward(torch.device("cpu")) is _delta_rule_like


def test_fla_failing_its_forward_leaves_the_triton_scan_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(q, k, v, g, beta, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    _fake_fla(monkeypatch, failing)
    with pytest.warns(RuntimeWarning, match="Triton scan there: RuntimeError: no kernel image is available"):
        assert delta_rule.fla_forward(torch.device("cpu")) is None
    assert delta_rule.fla_forward(torch.device("cpu")) is None  # checked once per device: no second warning


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_depthwise_conv_equals_torch_conv1d(device: str) -> None:
    """The short convolution a GatedDeltaNet layer runs (cuDNN's conv1d on a GPU, windows on CPU) equals
    ``F.conv1d`` of the same weights, with and without a bias (fp64 on CPU, fp32 on a GPU)."""
    dtype = torch.float64 if device == "cpu" else torch.float32
    gen = torch.Generator().manual_seed(3)
    full, weight, bias = (
        torch.randn(*shape, generator=gen, dtype=dtype).to(device) for shape in [(21, 6), (6, 4), (6,)]
    )
    for b in (bias, None):
        want = F.conv1d(full.t().unsqueeze(0), weight.unsqueeze(1), b, groups=6)[0].t()
        torch.testing.assert_close(hybrid.depthwise_conv(full, weight, b), want, rtol=1e-6, atol=1e-6)
