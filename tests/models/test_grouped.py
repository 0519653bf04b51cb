"""The MoE's routed experts as grouped matmuls (models/grouped.py) against the loop over experts they replace: the
same outputs and gradients (fp64: the padded bmm; fp32 on CPU: torch's grouped kernel), each token's slots added in
expert order bit for bit, the padded kernel's memory bounded, and no host sync on the device path. The GPU's grouped
kernel is checked against the padded one by the ``gpu`` test at the end (bench/gpu.sh runs it)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeCopyMode, FakeTensorMode

from longstraw_agents.engine import Engine
from longstraw_agents.models import grouped
from longstraw_agents.models.grouped import Groups, PaddedBmm, Routing, TorchGroupedMM, grouped_linear, kernel_for
from longstraw_agents.models.mla import MLAAdapter, MoE
from longstraw_agents.models.presets import glm_5_2_like, tiny_model

# the kernels the suite checks on CPU: the padded bmm in fp64, torch's grouped kernel where it runs (fp32 on CPU)
KERNELS = {"padded": (PaddedBmm, torch.float64), "torch": (TorchGroupedMM, torch.float32)}
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def per_expert_loop(
    moe: MoE, x: Tensor, top_idx: Tensor, weights: Tensor, gate_up: Tensor, down: Tensor, first: int = 0
) -> Tensor:
    """The routed experts as the model computed them before (and transformers' eager experts do): each chosen
    expert in id order on its tokens, added into the output one expert after another."""
    out = torch.zeros_like(x)
    for expert in range(first, first + len(gate_up)):
        token, slot = torch.where(top_idx == expert)
        if len(token) == 0:
            continue
        g, u = F.linear(x[token], gate_up[expert - first]).chunk(2, dim=-1)
        h = F.linear(moe.experts.act_fn(g) * u, down[expert - first])
        out = out.index_add(0, token, (h * weights[token, slot, None]).to(out.dtype))
    return out


@functools.cache
def moe_layer(dtype: torch.dtype) -> MoE:
    """The first MoE layer of a tiny GLM-MoE-DSA (8 experts, top-2 within one of 2 groups, hidden 64)."""
    model = tiny_model("glm_moe_dsa", dtype=dtype, seed=0)
    return next(layer.mlp for layer in Engine(model).adapter.layers if isinstance(layer.mlp, MoE))


def randn(*shape: int, dtype: torch.dtype, seed: int) -> Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def crafted_routing(dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``top_idx`` and router weights for 7 tokens over 8 experts, top-2: expert 5 chosen by none, expert 2 by
    most, slots in both orders (a token's larger expert first as often as not)."""
    top_idx = torch.tensor([[2, 0], [1, 2], [2, 7], [6, 2], [3, 4], [0, 7], [2, 3]])
    return top_idx, randn(7, 2, dtype=dtype, seed=3).abs()


def gradients(out: Tensor, inputs: list[Tensor]) -> list[Tensor]:
    upstream = randn(*out.shape, dtype=out.dtype, seed=9).to(out.device)
    found = torch.autograd.grad(out, inputs, upstream, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, found, strict=True)]


# --- grouped_linear ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("partial", [False, True], ids=["every-row-grouped", "rows-in-no-group"])
@pytest.mark.parametrize("skewed", [False, True], ids=["static-capacity", "largest-read"])
def test_grouped_linear_is_a_linear_per_group(monkeypatch, kernel, partial, skewed) -> None:
    """Rows sorted by group, each through its group's weight, with empty groups; rows past the last group (another
    rank's experts) get zeros and no gradient; an empty group's weight a zero gradient. ``skewed``: one group with
    most rows and no room to pad every group to the bound, so the padded kernel reads the largest group and runs
    the groups in several bmm calls."""
    kind, dtype = KERNELS[kernel]
    sizes = [8, 0, 1, 0, 2] if skewed else [3, 0, 4, 1, 2]
    rows_in_none = 1 if partial else 0
    if skewed:
        monkeypatch.setattr(grouped, "PADDED_ROWS", 0)  # (the budget: twice the real rows)
    n = sum(sizes) + rows_in_none
    rows = randn(n, 16, dtype=dtype, seed=1).requires_grad_()
    weight = randn(len(sizes), 8, 16, dtype=dtype, seed=2).requires_grad_()
    groups = Groups(torch.tensor(sizes).cumsum(0), n, most=n, partial=partial)
    assert kernel_for(rows, weight).__class__ is kind
    out = grouped_linear(rows, weight, groups)
    bounds = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    expected = torch.cat(
        [F.linear(rows[a:b], weight[g]) for g, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))]
        + [torch.zeros(rows_in_none, 8, dtype=dtype)]
    )
    torch.testing.assert_close(out, expected, rtol=TOL[dtype], atol=TOL[dtype])
    got, want = gradients(out, [rows, weight]), gradients(expected, [rows, weight])
    for name, g, w in zip(["rows", "weight"], got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=TOL[dtype], atol=TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")
    empty = [g for g, size in enumerate(sizes) if size == 0]
    assert torch.equal(got[1][empty], torch.zeros_like(got[1][empty]))
    if partial:
        assert torch.equal(got[0][-1], torch.zeros_like(got[0][-1]))
    if kernel == "padded":
        calls = groups.padding()
        assert (len(calls) > 1) == skewed
        assert all(c.count * c.capacity <= max(grouped.PADDED_ROWS, 2 * n) for c in calls)


def test_the_padded_kernel_bounds_what_it_pads() -> None:
    """GLM-5.2's shape (256 experts, top-8) at a 4,096-token chunk: padding every expert to the chunk's tokens would
    be 1M rows for 32,768 real ones. Even routing pads to a little over the real rows in one bmm; every token on one
    expert takes 16 bmm calls of at most twice the real rows each; a decoding batch of 64 tokens pads every expert
    to the batch (16,384 rows) without reading anything on the host."""
    experts, k, tokens = 256, 8, 4096
    even = Groups(torch.arange(1, experts + 1) * (tokens * k // experts), tokens * k, tokens, partial=False)
    (call,) = even.padding()
    assert call.count == experts and call.capacity * experts == tokens * k
    one = torch.full((experts,), tokens * k)
    one[0] = tokens  # (a token takes an expert once: the first expert has every token, the rest share the others)
    skewed = Groups(one, tokens * k, tokens, partial=False)
    calls = skewed.padding()
    assert len(calls) == experts // (2 * k) and all(c.count * c.capacity <= 2 * tokens * k for c in calls)
    decode = Groups(torch.arange(1, experts + 1).clamp(max=64 * k), 64 * k, 64, partial=False)
    with FakeTensorMode(allow_non_fake_inputs=True):  # (fails on any read of the counts)
        (call,) = decode.padding()
    assert call.capacity == 64 and call.count == experts


# --- the MoE -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("held", [(0, 8), (2, 2), (4, 4)], ids=["every-expert", "experts-2-3", "experts-4-7"])
def test_grouped_experts_equal_the_loop_over_experts(kernel, held) -> None:
    """The routed experts' sum and its gradients in the tokens, the routing weights and every expert weight, equal
    to the loop over experts: the whole layer, and a rank's share under expert parallelism (experts ``first ..
    first + count``; a token that chose none of them gets zeros). Expert 5 receives no token."""
    kind, dtype = KERNELS[kernel]
    moe = moe_layer(dtype)
    first, count = held
    x = randn(7, 64, dtype=dtype, seed=1).requires_grad_()
    top_idx, weights = crafted_routing(dtype)
    weights.requires_grad_()
    gate_up = moe.experts.gate_up_proj[first : first + count]
    down = moe.experts.down_proj[first : first + count]
    assert kernel_for(x, gate_up).__class__ is kind
    got = moe.experts_of(x, top_idx, weights, gate_up, down, first)
    want = per_expert_loop(moe, x, top_idx, weights, gate_up, down, first)
    torch.testing.assert_close(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    inputs = [x, weights, moe.experts.gate_up_proj, moe.experts.down_proj]
    names = ["tokens", "routing weights", "gate_up_proj", "down_proj"]
    for name, g, w in zip(names, gradients(got, inputs), gradients(want, inputs), strict=True):
        torch.testing.assert_close(g, w, rtol=TOL[dtype], atol=TOL[dtype], msg=lambda m, name=name: f"{name}: {m}")
    none = ~((top_idx >= first) & (top_idx < first + count)).any(dim=1)
    assert torch.equal(got[none], torch.zeros_like(got[none]))


def test_the_moe_equals_the_loop_through_its_router_and_with_the_largest_group_read(monkeypatch) -> None:
    """``MoE.__call__`` on routed tokens (fp64), the router's and the shared experts' gradients included, when the
    padded kernel reads the largest group on the host (its budget cut to twice the real rows)."""
    moe = moe_layer(torch.float64)
    monkeypatch.setattr(grouped, "PADDED_ROWS", 0)
    x = randn(13, 64, dtype=torch.float64, seed=4).requires_grad_()
    got = moe(x)
    top_idx, weights = moe.route(x)
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    want = per_expert_loop(moe, x, top_idx, weights, gate_up, down) + moe.moe.shared_experts(x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inputs = [x, *moe.moe.parameters()]
    for g, w in zip(gradients(got, inputs), gradients(want, inputs), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_each_tokens_slots_are_added_in_expert_order_bit_for_bit() -> None:
    """``Routing.combine`` adds a token's outputs as the loop over experts in id order does, exactly (so expert
    parallelism, which computes the experts on several ranks, sums as one process): outputs of very different
    sizes, where another order of the same additions rounds differently."""
    top_idx = torch.tensor([[3, 1, 2], [0, 2, 1], [2, 3, 0]])
    routing = Routing.of(top_idx, 0, 4, others=False)
    big = torch.tensor([1e16, 1.0, -1e16, 3.0], dtype=torch.float64)
    outputs = big[routing.keys][:, None] * torch.tensor([[1.0, 1.5]], dtype=torch.float64)  # (by each row's expert)
    weights = torch.ones(3, 3, dtype=torch.float64)
    out = torch.zeros(3, 2, dtype=torch.float64)
    for expert in range(4):
        token, slot = torch.where(top_idx == expert)
        rows = routing.inverse.view(3, 3).gather(1, routing.slots.argsort(dim=1))[token, slot]
        out = out.index_add(0, token, outputs[rows] * weights[token, slot, None])
    assert torch.equal(routing.combine(outputs, weights, torch.float64), out)
    in_slot_order = big[top_idx][..., None] * torch.tensor([1.0, 1.5], dtype=torch.float64)
    assert not torch.equal(in_slot_order[:, 0] + in_slot_order[:, 1] + in_slot_order[:, 2], out)  # (order shows)


def test_the_time_model_counts_a_moe_call_as_one_step() -> None:
    """One grouped call per MoE layer, however many experts its tokens chose (the per-expert loop was a step each)."""
    config = glm_5_2_like()
    for tokens in (1, 4096):
        work = MLAAdapter.layer_work(config, tokens, 0, 2)
        assert [w.steps for w in work] == [1.0 if kind == "sparse" else 0.0 for kind in config.mlp_layer_types]


# --- no host sync --------------------------------------------------------------------------------------------------
def fake_moe(dtype: torch.dtype, mode: FakeTensorMode) -> MoE:
    """The MoE layer with fake weights: shapes and dtypes, no data (so nothing can be read on the host)."""
    layer = moe_layer(dtype).moe
    with FakeCopyMode(mode):
        return MoE(copy.deepcopy(layer))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["padded-fp64", "torch-grouped-bf16"])
def test_the_moe_makes_no_host_sync(dtype) -> None:
    """``MoE.__call__`` forward and backward on fake tensors: a ``TorchDispatchMode`` (torch's ``FakeTensorMode``)
    that raises on ``aten._local_scalar_dense`` (``.item()``, ``.tolist()``, ``bool()``, ``int()``) and on every op
    whose output shape depends on data (``nonzero``, ``unique``, ``bincount``, boolean masks...): what a host sync
    or a CUDA graph capture would trip on. The padded kernel in fp64 (a decoding-sized batch) and torch's grouped
    kernel (bf16, which it takes on CPU as on Hopper)."""
    mode = FakeTensorMode()
    moe = fake_moe(dtype, mode)
    with mode:
        x = torch.randn(13, 64, dtype=dtype, requires_grad=True)
        out = moe(x)
        grads = torch.autograd.grad(out.sum(), [x, *moe.moe.parameters()], allow_unused=True)
    assert out.shape == x.shape and grads[0] is not None and grads[0].shape == x.shape


def test_the_padded_kernel_reads_the_largest_group_past_its_budget(monkeypatch) -> None:
    """The check above bites: where padding to the bound would exceed the budget, the padded kernel reads the
    largest group on the host (documented in models/grouped.py), and the fake mode refuses it."""
    monkeypatch.setattr(grouped, "PADDED_ROWS", 0)
    mode = FakeTensorMode()
    moe = fake_moe(torch.float64, mode)
    with mode, pytest.raises(DataDependentOutputException):
        moe(torch.randn(13, 64, dtype=torch.float64))


# --- on a GPU ------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_torchs_grouped_kernel_equals_the_padded_one_on_the_gpu_and_is_graphable() -> None:
    """On Hopper in bf16 torch's grouped kernel runs: its outputs and gradients equal the padded kernel's (bf16
    products, fp32 accumulation: to bf16's rounding), and a MoE call is captured in a CUDA graph (which fails on
    any host sync) and replays to the eager result."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("torch's grouped kernel runs on Hopper only (models/grouped.py)")
    moe = MoE(copy.deepcopy(moe_layer(torch.bfloat16).moe).cuda())
    x = randn(64, 64, dtype=torch.bfloat16, seed=1).cuda().requires_grad_()
    top_idx, weights = moe.route(x)
    assert isinstance(kernel_for(x, moe.experts.gate_up_proj), TorchGroupedMM)
    outs, grads = [], []
    for choice in ("auto", "padded"):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(grouped.CHOICE_ENV, choice)
            out = moe.local(x, top_idx, weights)
            outs.append(out.float())
            grads.append([g.float() for g in gradients(out, [x, moe.experts.gate_up_proj, moe.experts.down_proj])])
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    static = x.detach().clone()
    with torch.no_grad():
        side = torch.cuda.Stream()  # (warm-up on a side stream, as torch's CUDA graph notes do)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            moe(static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe(static)
        static.copy_(randn(64, 64, dtype=torch.bfloat16, seed=2).cuda())
        graph.replay()
        torch.testing.assert_close(captured, moe(static))
