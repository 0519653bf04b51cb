"""The delta rule's Triton scan (kernels/delta_scan.py) equals the pure-torch scan: outputs, final state and the
gradients of every input and of the initial state. On CPU the kernels run in Triton's interpreter (tests/conftest.py
sets ``TRITON_INTERPRET``) in fp64, equal to rounding; on a GPU (``-m gpu``) compiled, in fp32, at Qwen3.6's head
sizes and a whole capture chunk. The interpreter cannot catch a GPU code-generation bug, hence the GPU test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models import delta_rule
from longstraw_agents.models.base import MixerInput
from longstraw_agents.models.delta_rule import chunk_gated_delta_rule, torch_scan, triton_scan
from longstraw_agents.models.hybrid import GatedDeltaNetMixer
from longstraw_agents.models.presets import tiny_model


def random_inputs(n: int, heads: int, dk: int, dv: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    """q, k, v, log decays, write strengths and an initial state, each a leaf that requires grad."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    g = -F.softplus(rand(n, heads))
    beta = torch.sigmoid(rand(n, heads))
    inputs = [rand(n, heads, dk), rand(n, heads, dk), rand(n, heads, dv), g, beta, 0.3 * rand(heads, dk, dv)]
    return [t.to(device, dtype).requires_grad_(True) for t in inputs]


def outputs_and_gradients(inputs, scan, chunk: int, with_final: bool = True):
    out, final = chunk_gated_delta_rule(*inputs, chunk=chunk, scan=scan)
    gen = torch.Generator().manual_seed(1)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=torch.float64).to(out)).sum()
    if with_final:
        loss = loss + (final * torch.randn(final.shape, generator=gen, dtype=torch.float64).to(final)).sum()
    wrt = [t for t in inputs if t is not None]
    return out, final, torch.autograd.grad(loss, wrt)


# (positions, heads, D_k, D_v, block): odd head sizes and a partial last block; D_v over two column blocks (32 + 16,
# masked); one position (a decoding step, the block cut to it); several whole blocks of Qwen-like shape
SHAPES = [(150, 3, 5, 4, 16), (130, 2, 32, 48, 64), (1, 4, 16, 16, 64), (192, 2, 16, 64, 64)]


@pytest.mark.parametrize(("n", "heads", "dk", "dv", "chunk"), SHAPES, ids=lambda v: str(v))
def test_the_triton_scan_equals_the_torch_scan_with_gradients_fp64(n, heads, dk, dv, chunk) -> None:
    inputs = random_inputs(n, heads, dk, dv, torch.float64)
    got_out, got_final, got_grads = outputs_and_gradients(inputs, triton_scan, chunk)
    out, final, grads = outputs_and_gradients(inputs, torch_scan, chunk)
    torch.testing.assert_close(got_out, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_final, final, rtol=1e-12, atol=1e-12)
    names = ["q", "k", "v", "g", "beta", "initial state"]
    for name, got, want in zip(names, got_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")


def test_no_initial_state_and_no_final_state_gradient() -> None:
    """The kernels' two optional inputs: a zero initial state (none given) and no gradient for the final state."""
    *inputs, _ = random_inputs(70, 2, 16, 16, torch.float64)
    got_out, _, got_grads = outputs_and_gradients([*inputs, None], triton_scan, 32, with_final=False)
    out, _, grads = outputs_and_gradients([*inputs, None], torch_scan, 32, with_final=False)
    torch.testing.assert_close(got_out, out, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def test_a_gated_delta_net_layer_through_the_triton_scan_equals_the_torch_scan(monkeypatch) -> None:
    """The tiny hybrid model's GatedDeltaNet layer (D_k = D_v = 8: blocks padded to the kernels' 16) in fp64, run
    from a recurrent state in two pieces, forward and backward, with the Triton scan and with the torch scan."""
    model = tiny_model("qwen3_5", dtype=torch.float64)
    mixer = GatedDeltaNetMixer(model.model.layers[0].linear_attn)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(90, model.config.hidden_size, generator=gen, dtype=torch.float64, requires_grad=True)
    rope = (torch.empty(0), torch.empty(0))
    positions = torch.arange(90)
    tail_shape, state_shape = mixer.state_shapes()
    initial = (
        torch.randn(tail_shape, generator=gen, dtype=torch.float64),
        torch.randn(state_shape, generator=gen, dtype=torch.float64).requires_grad_(True),
    )

    def run(scan):
        monkeypatch.setattr(delta_rule, "scan_for", lambda q, choice="auto": scan)
        first = mixer.forward(MixerInput(x[:40], positions[:40], rope, recurrent=initial))
        second = mixer.forward(MixerInput(x[40:], positions[40:], rope, recurrent=first.new))
        y = torch.cat([first.y, second.y])
        loss = (y * y).sum() + second.new[1].sum()
        return y, torch.autograd.grad(loss, [x, initial[1], mixer.mod.in_proj_qkv.weight, mixer.mod.A_log])

    got_y, got_grads = run(triton_scan)
    y, grads = run(torch_scan)
    torch.testing.assert_close(got_y, y, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_grads, grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_cpu_tensors_take_the_torch_scan_and_a_wrong_choice_is_refused(monkeypatch) -> None:
    q = torch.zeros(3, 2, 4)
    assert delta_rule.scan_for(q) is torch_scan  # the interpreter is for tests: CPU runs the pure-torch scan
    monkeypatch.setenv(delta_rule.CHOICE_ENV, "fast")
    with pytest.raises(ValueError, match="LONGSTRAW_DELTA_RULE='fast': choose one of auto, triton, torch"):
        delta_rule.delta_rule(q, q, q, q[..., 0], q[..., 0], None)


@pytest.mark.parametrize(("n", "heads", "dk", "dv", "chunk"), SHAPES[:2], ids=lambda v: str(v))
def test_the_planners_meta_scan_allocates_what_the_triton_scan_does(n, heads, dk, dv, chunk, monkeypatch) -> None:
    """On the meta device the scan is ``MetaScan``: the Triton scan's buffers, no work (the planner's probes). Its
    peak, what it holds after the forward and after the backward equal the Triton scan's, D_v over two column
    blocks included. The kernels write into the buffers they are given; their launches are left out here because
    the interpreter copies every tensor to the host and back, which a GPU does not."""
    from longstraw_agents.kernels import delta_scan

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(delta_scan, "_scan_forward_kernel", NoLaunch())
    monkeypatch.setattr(delta_scan, "_scan_backward_kernel", NoLaunch())

    def scan_bytes(scan, device: str) -> tuple[int, int, int]:
        inputs = [t.detach().to(device).requires_grad_(True) for t in random_inputs(n, heads, dk, dv, torch.float64)]
        terms = delta_rule.block_terms(*inputs[:5], chunk)
        terms = type(terms)(*(t.detach().requires_grad_(True) for t in terms))
        with MemoryTracker() as tracker:
            out, final = scan(terms, inputs[5])
            held = tracker.current_bytes
            torch.autograd.backward((out, final), (torch.ones_like(out), torch.ones_like(final)))
        return held, tracker.peak_bytes, tracker.current_bytes

    assert delta_rule.scan_for(torch.zeros(1, 1, 1, device="meta")) is delta_rule.meta_scan
    assert scan_bytes(delta_rule.meta_scan, "meta") == scan_bytes(triton_scan, "cpu")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.gpu
@pytest.mark.parametrize("n", [150, 4096])
def test_the_compiled_triton_scan_equals_the_torch_scan_on_the_gpu(n: int) -> None:
    """fp32 on CUDA at Qwen3.6's head sizes (D_k = D_v = 128, 16 heads): 150 positions (a partial block) and a whole
    capture chunk; outputs, final state and every gradient, the initial state's included. Both run full-precision
    products (the kernel never uses TF32; torch's fp32 matmuls neither, by default), so only the order of sums
    differs."""
    inputs = random_inputs(n, 16, 128, 128, torch.float32, device="cuda")
    got_out, got_final, got_grads = outputs_and_gradients(inputs, triton_scan, 64)
    out, final, grads = outputs_and_gradients(inputs, torch_scan, 64)
    assert relative_error(got_out, out) < 1e-4
    assert relative_error(got_final, final) < 1e-4
    names = ["q", "k", "v", "g", "beta", "initial state"]
    for name, got, want in zip(names, got_grads, grads, strict=True):
        assert relative_error(got, want) < 1e-4, name
