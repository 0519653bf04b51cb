"""The attention core (attention.py) against plain softmax attention over the concatenated keys, fp64, for every
backend present: random splits of the earlier keys into blocks (blocks of one key, empty blocks, pieces), the causal
own block, GQA, MLA's shared key/value rows, gradients of queries, own keys/values and — through the sinks — of the
blocks' keys and values; DSA's sparse form with rows that see no key of a block."""

from __future__ import annotations

import pytest
import torch

from longstraw_agents import attention as attention_module
from longstraw_agents.attention import (
    BACKENDS,
    Attention,
    AttentionBackend,
    CpuFlashBackend,
    CudaCudnnBackend,
    CudaFlashBackend,
    EagerBackend,
    KVBlock,
    ShapeClass,
    TunedBackend,
    merge,
    partial_attention,
    sparse_attend,
)

H, H_KV, D, DV = 6, 2, 8, 8
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def backend_params() -> list:
    cpu = [
        pytest.param("eager", torch.float64),
        pytest.param("cpu-flash", torch.float64),
        pytest.param("cpu-flash", torch.bfloat16),  # fused forward, eager backward in fp32
    ]
    cuda = [pytest.param(name, torch.bfloat16, marks=pytest.mark.gpu) for name in ("cuda-flash", "cuda")]
    return cpu + cuda


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 2e-2, "atol": 2e-2}


def reference(q, keys, values, scale: float) -> torch.Tensor:
    """Causal softmax attention of the last n positions over all keys; ``q [n, H, D]``, keys ``[M, H_kv, D]``."""
    n, total = q.shape[0], keys.shape[0]
    groups = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(groups, dim=1)
    v = values.repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k.double()) * scale
    hidden = torch.arange(total)[None, :] > (torch.arange(n) + total - n)[:, None]
    probs = torch.softmax(scores.masked_fill(hidden.to(scores.device), float("-inf")), dim=-1)
    return torch.einsum("hnm,mhd->nhd", probs, v.double())


def random_case(sizes: list[int], n: int, dtype: torch.dtype, seed: int = 0, dv: int = DV):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(DEVICE, dtype)

    q = rand(n, H, D)
    blocks = [(rand(m, H_KV, D), rand(m, H_KV, dv)) for m in sizes]
    return q, blocks, rand(n, H_KV, D), rand(n, H_KV, dv)


SPLITS = [
    pytest.param([], 5, id="own-only"),
    pytest.param([7], 5, id="one-block"),
    pytest.param([1, 0, 9, 1], 4, id="tiny-and-empty-blocks"),
    pytest.param([40, 3, 17], 6, id="several"),
    pytest.param([5], 1, id="one-query"),
]


@pytest.mark.parametrize(("backend", "dtype"), backend_params())
@pytest.mark.parametrize(("sizes", "n"), SPLITS)
def test_forward_equals_softmax_over_the_concatenated_keys(backend: str, dtype, sizes, n) -> None:
    q, blocks, own_k, own_v = random_case(sizes, n, dtype)
    attention = Attention(backend, max_score_elements=60, max_piece=4)  # eager: pieces of keys
    out = attention(q, [KVBlock(k, v) for k, v in blocks], own_k, own_v, 0.3)
    keys = torch.cat([k for k, _ in blocks] + [own_k])
    values = torch.cat([v for _, v in blocks] + [own_v])
    torch.testing.assert_close(out.double(), reference(q, keys, values, 0.3), **tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("piece", "n"), [(3, 10), (3, 9), (CpuFlashBackend.CAUSAL_PIECE, 300)])
def test_a_long_causal_block_runs_in_pieces_with_the_same_result(dtype, piece: int, n: int, monkeypatch) -> None:
    """cpu-flash splits the queries' own causal block into pieces (each a causal square plus its earlier keys as a
    full block): forward and gradients as over the whole block, pieces of one query included."""
    monkeypatch.setattr(CpuFlashBackend, "CAUSAL_PIECE", piece)
    q, blocks, own_k, own_v = random_case([4], n, dtype, seed=3)
    leaves = [t.requires_grad_(True) for t in (q, own_k, own_v)]
    out = Attention("cpu-flash")(q, [KVBlock(*blocks[0])], own_k, own_v, 0.3)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    keys, values = torch.cat([blocks[0][0].double(), ref_leaves[1]]), torch.cat([blocks[0][1].double(), ref_leaves[2]])
    want = reference(ref_leaves[0], keys, values, 0.3)
    torch.testing.assert_close(out.double(), want, **tolerance(dtype))
    weight = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad((out * weight.to(dtype)).sum(), leaves)
    for g, w in zip(got, torch.autograd.grad((want * weight).sum(), ref_leaves), strict=True):
        torch.testing.assert_close(g.double(), w, **tolerance(dtype))


@pytest.mark.parametrize(("backend", "dtype"), backend_params())
@pytest.mark.parametrize("max_piece", [3, 1 << 16])
def test_gradients_reach_queries_own_keys_and_the_block_sinks(backend: str, dtype, max_piece: int) -> None:
    q, blocks, own_k, own_v = random_case([6, 1, 9], 3, dtype, seed=1)
    leaves = [t.requires_grad_(True) for t in (q, own_k, own_v)]
    sinks = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in blocks]
    kv_blocks = [KVBlock(k, v, dk, dv) for (k, v), (dk, dv) in zip(blocks, sinks, strict=True)]
    weight = torch.randn(3, H, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    out = Attention(backend, max_score_elements=40, max_piece=max_piece)(q, kv_blocks, own_k, own_v, 0.5)
    got = torch.autograd.grad((out * weight).sum(), leaves)

    ref_blocks = [(k.double().requires_grad_(True), v.double().requires_grad_(True)) for k, v in blocks]
    ref_leaves = [t.detach().double().requires_grad_(True) for t in (q, own_k, own_v)]
    keys = torch.cat([k for k, _ in ref_blocks] + [ref_leaves[1]])
    values = torch.cat([v for _, v in ref_blocks] + [ref_leaves[2]])
    loss = (reference(ref_leaves[0], keys, values, 0.5) * weight.double()).sum()
    want = torch.autograd.grad(loss, ref_leaves + [t for block in ref_blocks for t in block])
    for g, w in zip(got, want[:3], strict=True):
        torch.testing.assert_close(g.double(), w, **tolerance(dtype))
    for sink, w in zip([t for pair in sinks for t in pair], want[3:], strict=True):
        torch.testing.assert_close(sink.double(), w, **tolerance(dtype))


def test_partials_over_disjoint_blocks_merge_into_the_attention_over_all_of_them() -> None:
    q, blocks, _, _ = random_case([5, 1, 7], 3, torch.float64, seed=6)
    attention = Attention("auto")
    first_out, first_lse = partial_attention(q, [KVBlock(*blocks[0])], attention, 0.3)
    rest_out, rest_lse = partial_attention(q, [KVBlock(k, v) for k, v in blocks[1:]], attention, 0.3)
    out, _ = merge((first_out, first_lse), rest_out, rest_lse)
    keys, values = torch.cat([k for k, _ in blocks]), torch.cat([v for _, v in blocks])
    full = torch.softmax(torch.einsum("nhd,mhd->hnm", q, keys.repeat_interleave(3, 1)) * 0.3, dim=-1)
    torch.testing.assert_close(out, torch.einsum("hnm,mhd->nhd", full, values.repeat_interleave(3, 1)))
    with pytest.raises(ValueError, match="at least one"):
        partial_attention(q, [], attention, 0.3)


def test_a_block_without_sinks_gets_no_gradient_and_leaves_nothing_behind() -> None:
    q, blocks, own_k, own_v = random_case([4], 2, torch.float64)
    q.requires_grad_(True)
    (k, v) = blocks[0]
    out = Attention("eager")(q, [KVBlock(k, v)], own_k, own_v, 0.5)
    out.sum().backward()
    assert q.grad is not None and k.grad is None and not k.requires_grad


def test_eager_passes_gradcheck_with_different_value_width() -> None:
    q, blocks, own_k, own_v = random_case([3], 2, torch.float64, dv=5)
    leaves = tuple(t.requires_grad_(True) for t in (q, own_k, own_v))
    k, v = blocks[0]
    attention = Attention("eager", max_score_elements=7)

    def run(q, own_k, own_v):
        return attention(q, [KVBlock(k, v)], own_k, own_v, 0.7)

    assert torch.autograd.gradcheck(run, leaves)


def test_mla_rows_as_keys_and_values_equal_latent_attention() -> None:
    """One KV head whose keys and values are the same rows [latent ; rope]: the first ``rank`` output columns are
    attention over the latent, and the rows' gradient is the sum of their key and value gradients."""
    rank, rope, n = 6, 2, 3
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(n, 4, rank + rope, dtype=torch.float64, generator=gen)
    past = torch.randn(5, rank + rope, dtype=torch.float64, generator=gen)
    own = torch.randn(n, rank + rope, dtype=torch.float64, generator=gen, requires_grad=True)
    sink = torch.zeros_like(past)
    out = Attention("cpu-flash")(
        q, [KVBlock(past[:, None], past[:, None], sink[:, None], sink[:, None])], own[:, None], own[:, None], 0.4
    )
    latent_out = out[..., :rank]
    ref_past = past.clone().requires_grad_(True)
    rows = torch.cat([ref_past, own])
    want = reference(q, rows[:, None], rows[:, None, :rank], 0.4)
    torch.testing.assert_close(latent_out, want, rtol=1e-12, atol=1e-12)
    latent_out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(sink, ref_past.grad, rtol=1e-12, atol=1e-12)


def test_auto_picks_a_fused_backend_when_it_can_and_eager_otherwise() -> None:
    q, blocks, _, _ = random_case([4], 2, torch.float64)
    q4, k4 = q.transpose(0, 1)[None], blocks[0][0].transpose(0, 1)[None]
    assert isinstance(Attention("auto").kernel(q4, k4, k4), BACKENDS["cuda" if q.is_cuda else "cpu-flash"])
    narrow = k4[..., :5]
    assert isinstance(Attention("auto").kernel(q4, k4, narrow), EagerBackend)  # Dv != D: no fused kernel
    with pytest.raises(ValueError, match="cannot take"):
        Attention("cpu-flash").kernel(q4, k4, narrow)
    with pytest.raises(ValueError, match="unknown attention backend"):
        Attention("flash-9")


def test_every_backend_declares_a_name() -> None:
    assert all(issubclass(b, AttentionBackend) and b.name == name for name, b in BACKENDS.items())


def sparse_reference(q, rows, selected, start, scale):
    """Each query over its selected visible positions only, from the definition (fp64)."""
    n = q.shape[0]
    scores = torch.einsum("nhw,mw->nhm", q, rows) * scale
    allowed = torch.zeros(n, rows.shape[0], dtype=torch.bool)
    for i in range(n):
        for pos in selected[i].tolist():
            if pos <= start + i:
                allowed[i, pos] = True
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    return torch.einsum("nhm,mw->nhw", probs, rows)


SPARSE_PATHS = [
    pytest.param(1 << 20, False, id="gathered"),
    pytest.param(2 * 4 * 6, False, id="gathered-two-queries-at-a-time"),
    pytest.param(1 << 20, True, id="triton-kernel"),  # in Triton's interpreter on CPU
]


@pytest.mark.parametrize(("budget", "kernel"), SPARSE_PATHS)
@pytest.mark.parametrize("own_rows", [5, 2], ids=["own-longest", "a-block-longest"])
def test_sparse_attention_and_its_gradients_equal_the_definition(budget, kernel, own_rows, monkeypatch) -> None:
    monkeypatch.setattr(attention_module, "sparse_kernel_applies", lambda q, spans: kernel)
    gen = torch.Generator().manual_seed(5)
    n, W, start = own_rows, 6, 7
    blocks = [
        torch.randn(3, W, dtype=torch.float64, generator=gen),
        torch.randn(4, W, dtype=torch.float64, generator=gen),
    ]
    own = torch.randn(n, W, dtype=torch.float64, generator=gen, requires_grad=True)
    q = torch.randn(n, 2, W, dtype=torch.float64, generator=gen, requires_grad=True)
    # rows 1 and 3 select nothing in either earlier block (their partials there are fully masked)
    selected = torch.tensor([[0, 7, 8, 9], [8, 9, 10, 11], [1, 2, 3, 9], [11, 10, 9, 8], [4, 5, 6, 8]])[:n]
    sinks = [torch.zeros_like(b) for b in blocks]
    out = sparse_attend(q, blocks, sinks, own, selected, start, 0.5, attention=Attention(max_score_elements=budget))
    leaves = [b.clone().requires_grad_(True) for b in blocks]
    ref_q, ref_own = q.detach().clone().requires_grad_(True), own.detach().clone().requires_grad_(True)
    want = sparse_reference(ref_q, torch.cat([*leaves, ref_own]), selected, start, 0.5)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    (want * weight).sum().backward()
    torch.testing.assert_close(q.grad, ref_q.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(own.grad, ref_own.grad, rtol=1e-10, atol=1e-10)
    for sink, leaf in zip(sinks, leaves, strict=True):
        torch.testing.assert_close(sink, leaf.grad, rtol=1e-10, atol=1e-10)


# --- the tuned backend: the fastest kernel whose results match the reference's, per shape class ---------------------


class SkewedBackend(EagerBackend):
    """Eager math with its output off by 10 %: a kernel that is fast and wrong."""

    name = "skewed"

    def forward(self, q, k, v, causal, scale):
        out, lse = super().forward(q, k, v, causal, scale)
        return out * 1.1, lse


class RefusingBackend(EagerBackend):
    name = "refusing"

    def forward(self, q, k, v, causal, scale):
        raise RuntimeError("cuDNN Frontend error: no valid execution plans built")


def tuned(times: dict[str, float], candidates=(EagerBackend, CpuFlashBackend)) -> tuple[TunedBackend, list]:
    """A tuned backend over CPU kernels whose timings are ``times`` (seconds per kernel name, no clock read), and the
    list of (kernel, direction) it measured."""
    measured: list[tuple[str, str]] = []

    class Tuned(TunedBackend):
        name = "tuned"
        CANDIDATES = candidates
        choices = {}

        def seconds(self, kernel, direction, args):
            measured.append((kernel.name, direction))
            return times[kernel.name]

    return Tuned(), measured


def test_the_tuned_backend_takes_the_faster_kernel_per_direction_and_shape_class() -> None:
    q, blocks, _, _ = random_case([40], 8, torch.float64)
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, *blocks[0]))
    backend, measured = tuned({"eager": 2.0, "cpu-flash": 1.0})
    out, lse = backend.forward(q4, k4, v4, False, 0.3)
    want_out, want_lse = EagerBackend().forward(q4, k4, v4, False, 0.3)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert backend.choices == {("forward", ShapeClass.of(q4, k4, False)): CpuFlashBackend}
    backend.forward(q4, k4, v4, False, 0.3)  # the class is measured once
    backend.forward(q4[:, :, :5], k4[:, :, :33], v4[:, :, :33], False, 0.3)  # 8 -> 8 queries, 64 -> 64 keys
    assert measured == [("eager", "forward"), ("cpu-flash", "forward")]
    backend.backward(torch.ones_like(out), q4, k4, v4, out, lse, False, 0.3)  # backward: chosen apart
    backend.forward(q4, k4[:, :, :20], v4[:, :, :20], False, 0.3)  # 20 keys: another class
    assert len(measured) == 6
    assert len(backend.choices) == 3


@pytest.mark.parametrize(
    ("times", "candidates", "chosen"),
    [
        pytest.param({"eager": 1.0, "cpu-flash": 0.96}, (EagerBackend, CpuFlashBackend), EagerBackend, id="margin"),
        pytest.param({"eager": 1.0, "skewed": 0.1}, (EagerBackend, SkewedBackend), EagerBackend, id="wrong"),
        pytest.param({"eager": 1.0, "refusing": 0.1}, (EagerBackend, RefusingBackend), EagerBackend, id="refusing"),
    ],
)
def test_the_tuned_backend_keeps_the_reference_unless_another_kernel_is_right_and_clearly_faster(
    times, candidates, chosen
) -> None:
    q, blocks, _, _ = random_case([9], 4, torch.float64)
    q4, k4, v4 = (t.transpose(0, 1)[None] for t in (q, *blocks[0]))
    backend, _ = tuned(times, candidates)
    backend.forward(q4, k4, v4, True, 0.3)
    assert list(backend.choices.values()) == [chosen]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_attention_equals_flash_where_cudnn_takes_the_shape(causal: bool) -> None:
    """cuDNN's forward (output and log-sum-exp) and its backward given flash's global output and log-sum-exp, at
    Qwen3-like shapes (16 query heads over 2 KV heads of 128, a 4,096-query chunk over 8,192 earlier keys or its own
    causal block), against FlashAttention-2's."""
    gen = torch.Generator().manual_seed(0)
    n, m = 4096, 4096 if causal else 8192
    q = torch.randn(1, 16, n, 128, generator=gen).to("cuda", torch.bfloat16)
    k, v = (torch.randn(1, 2, m, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
    d_out = torch.randn(1, 16, n, 128, generator=gen).to("cuda", torch.bfloat16)
    flash, cudnn = CudaFlashBackend(), CudaCudnnBackend()
    out, lse = flash.forward(q, k, v, causal, 0.08)
    try:
        got_out, got_lse = cudnn.forward(q, k, v, causal, 0.08)
        got_grads = cudnn.backward(d_out, q, k, v, out, lse, causal, 0.08)
    except RuntimeError as err:
        pytest.skip(f"cuDNN refuses the shape here: {err}")
    torch.testing.assert_close(got_lse, lse, rtol=1e-3, atol=1e-3)
    assert float((got_out.double() - out.double()).norm() / out.double().norm()) < 1e-2
    for got, want in zip(got_grads, flash.backward(d_out, q, k, v, out, lse, causal, 0.08), strict=True):
        assert float((got.double() - want.double()).norm() / want.double().norm()) < 2e-2
