"""DeepSeek sparse attention's Triton kernels — the indexer's scores (kernels/index_scores.py) and the sparse
attention over MLA's rows (kernels/sparse_attention.py) — against the pure-torch paths, in Triton's interpreter on
CPU (tests/conftest.py sets ``TRITON_INTERPRET``): the scores and the attention with its gradients in fp64 to
rounding, the engine's logits, selections and exact-mode gradients through both kernels equal to the torch paths',
and the fast (bf16 tensor-core) products as the interpreter emulates them. On a GPU (``-m gpu``) the compiled
kernels against the torch paths at GLM-5.2's row width."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import longstraw_agents.models.mla as mla
from longstraw_agents import attention
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.kernels.index_scores import index_scores
from longstraw_agents.kernels.sparse_attention import sparse_forward
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.trainer import grpo_backward


def per_head_scores(q, w, keys, scale):
    """The definition: ``sum_h w_h relu(scale q_h . k)`` (fp64)."""
    return torch.einsum("nh,nhm->nm", w, F.relu(torch.einsum("nhd,md->nhm", q, keys) * scale))


@pytest.mark.parametrize(("n", "heads", "dim", "m"), [(70, 3, 12, 100), (5, 1, 16, 3), (1, 4, 40, 65)])
def test_the_index_kernel_equals_the_definition_fp64(n, heads, dim, m) -> None:
    """Query and key blocks that end part-way (70 queries, 100 keys over blocks of 64), head sizes that are not
    powers of two, one query; some keys zero, so that whole columns tie at exactly 0."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, dim, generator=gen, dtype=torch.float64)
    w = torch.randn(n, heads, generator=gen, dtype=torch.float64)
    keys = torch.randn(m, dim, generator=gen, dtype=torch.float64)
    keys[::3] = 0.0
    got = index_scores(q, w, keys, 0.2, fast=False)
    torch.testing.assert_close(got, per_head_scores(q, w, keys, 0.2), rtol=1e-12, atol=1e-12)
    assert not got[:, ::3].signbit().any()  # exact zeros are +0.0, so that they tie with each other


def test_fast_products_round_the_operands_to_bf16_and_nothing_else() -> None:
    """On bf16 values (what a bf16 model's rows and queries are) the fast products are exact: the index scores
    equal the fp32 ones; the sparse attention rounds its probabilities to bf16 for the value product only."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(6, 3, 32, generator=gen).bfloat16().float()
    w, keys = torch.randn(6, 3, generator=gen), torch.randn(50, 32, generator=gen).bfloat16()
    exact = index_scores(q, w, keys.float(), 0.2, fast=False)
    torch.testing.assert_close(index_scores(q, w, keys, 0.2, fast=True), exact, rtol=1e-6, atol=1e-6)
    queries, rows = torch.randn(5, 2, 40, generator=gen).bfloat16(), torch.randn(30, 40, generator=gen).bfloat16()
    selected = torch.stack([torch.randperm(30, generator=gen)[:8] for _ in range(5)])
    fast = sparse_forward(queries, rows, selected, 0, 29, 32, 0.3, True)
    full = sparse_forward(queries.float(), rows.float(), selected, 0, 29, 32, 0.3, False)
    torch.testing.assert_close(fast[1], full[1], rtol=1e-6, atol=1e-6)  # the scores' products are exact
    assert float((fast[0] - full[0]).norm() / full[0].norm()) < 1e-2


def test_the_engine_through_the_dsa_kernels_equals_the_torch_paths_fp64(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny GLM-5.2 layout (topk 4 of up to 20 keys: real selections) in exact mode: a 16-token prompt captured
    in chunks of 8 and two completions — every layer's selection, and the gradient of every parameter (through the
    state's rows: the kernel's atomic adds into the gradient sinks)."""
    net = tiny_model("glm_moe_dsa", dtype=torch.float64, index_topk=4)
    ids = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(3))
    selections: list[torch.Tensor | None] = []
    select = mla.DSAIndexer.select
    monkeypatch.setattr(mla.DSAIndexer, "select", lambda *a, **k: selections.append(select(*a, **k)) or selections[-1])

    def run() -> tuple[list, list[torch.Tensor]]:
        selections.clear()
        net.zero_grad(set_to_none=True)
        engine = Engine(net, EngineConfig(chunk_size=8, max_score_elements=64))
        grpo_backward(engine, ids[:16], [ids[16:19], ids[19:21]], [1.0, 0.0], "exact")
        return list(selections), [p.grad.clone() for p in net.parameters() if p.grad is not None]

    want_selections, want_grads = run()
    monkeypatch.setattr(attention, "sparse_kernel_applies", lambda q, spans: True)
    monkeypatch.setattr(mla, "index_kernel_applies", lambda q: True)
    got_selections, grads = run()
    assert len(got_selections) == len(want_selections) > 0
    assert any(s is not None for s in want_selections)
    for got, want in zip(got_selections, want_selections, strict=True):
        assert (got is None and want is None) or torch.equal(got, want)
    assert len(grads) == len(want_grads) > 0
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.gpu
def test_the_compiled_dsa_kernels_equal_the_torch_paths_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """GLM-5.2's row width (512 latent + 64 rope), 16 heads, top-256 of 2,048 rows, 512 queries; bf16 rows with the
    fast products and fp32 with exact ones: outputs, the queries' gradient and the rows' gradients (added into the
    sinks atomically), and the index scores."""
    gen = torch.Generator().manual_seed(0)
    n, heads, width, m, k = 512, 16, 576, 2048, 256
    for dtype, exact, tolerance in [(torch.float32, True, 1e-4), (torch.bfloat16, False, 2e-2)]:
        q = torch.randn(n, heads, width, generator=gen).to("cuda", dtype).requires_grad_(True)
        rows = torch.randn(m, width, generator=gen).to("cuda", dtype)
        own = torch.randn(n, width, generator=gen).to("cuda", dtype).requires_grad_(True)
        selected = torch.stack([torch.randperm(m + n, generator=gen)[:k] for _ in range(n)]).cuda()
        weight = torch.randn(n, heads, width, generator=gen).to("cuda", dtype)

        def run(kernel: bool, q=q, rows=rows, own=own, selected=selected, weight=weight, exact=exact):
            monkeypatch.setattr(attention, "sparse_kernel_applies", lambda q, spans: kernel)
            sink = torch.zeros(m, width, device="cuda")
            out = attention.sparse_attend(
                q, [rows], [sink], own, selected, m, 0.05, attention=attention.Attention(exact_products=exact)
            )
            d_q, d_own = torch.autograd.grad((out * weight).sum(), [q, own])
            return out, d_q, d_own, sink

        for name, got, want in zip(["out", "dq", "d_own", "d_rows"], run(True), run(False), strict=True):
            assert relative_error(got, want) < tolerance, (dtype, name)
    q = torch.randn(n, 8, 128, generator=gen).cuda()
    w, keys = torch.randn(n, 8, generator=gen).cuda(), torch.randn(m, 128, generator=gen).cuda()
    want = torch.einsum("nh,nhm->nm", w, F.relu(torch.einsum("nhd,md->nhm", q.double(), keys.double()) * 0.1))
    assert relative_error(index_scores(q, w, keys, 0.1, fast=False), want) < 1e-5
