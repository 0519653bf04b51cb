"""The attention primitive (attention.py) against plain softmax attention over the concatenated keys (fp64): random
splits of the earlier keys into blocks (blocks of one key, empty blocks, pieces by the score budget), the causal
own block, GQA, and gradients of queries, keys and values."""

from __future__ import annotations

import pytest
import torch

from longstraw_agents.attention import attend, block_partial, causal_mask, merge

H_KV, GROUPS, D, DV = 2, 3, 8, 6


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, n: int) -> torch.Tensor:
    """Causal softmax attention of the last ``n`` positions over all ``keys`` (``q``: ``[H_kv, groups*n, D]``)."""
    scores = torch.einsum("hrd,mhd->hrm", q, keys) * scale
    total = keys.shape[0]
    q_pos = (torch.arange(n) + total - n).repeat(GROUPS)  # group-major rows
    hidden = torch.arange(total)[None, :] > q_pos[:, None]
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return torch.einsum("hrm,mhd->hrd", probs, values)


def random_case(past_sizes: list[int], n: int, seed: int = 0, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_(requires_grad)

    q = rand(H_KV, GROUPS * n, D)
    past = [(rand(m, H_KV, D), rand(m, H_KV, DV)) for m in past_sizes]
    own = (rand(n, H_KV, D), rand(n, H_KV, DV))
    return q, past, own


@pytest.mark.parametrize(
    ("past_sizes", "n", "max_score_elements"),
    [([], 5, 1 << 20), ([7], 5, 1 << 20), ([1, 0, 9, 1], 4, 1 << 20), ([40, 3], 6, 50), ([5], 1, 1)],
    ids=["own-only", "one-block", "tiny-and-empty-blocks", "pieces", "one-key-pieces"],
)
def test_attend_equals_softmax_over_the_concatenated_keys(past_sizes, n, max_score_elements) -> None:
    q, past, own = random_case(past_sizes, n)
    scale = D**-0.5
    out = attend(q, past, own, scale, GROUPS, max_score_elements)
    keys = torch.cat([k for k, _ in past] + [own[0]])
    values = torch.cat([v for _, v in past] + [own[1]])
    torch.testing.assert_close(out, reference(q, keys, values, scale, n), rtol=1e-12, atol=1e-12)


def test_gradients_of_queries_keys_and_values_equal_the_reference() -> None:
    q, past, own = random_case([6, 1, 4], 3, seed=1, requires_grad=True)
    scale = 0.7
    leaves = [q, *[t for block in past for t in block], *own]
    weight = torch.randn(H_KV, GROUPS * 3, DV, dtype=torch.float64)
    got = torch.autograd.grad((attend(q, past, own, scale, GROUPS, 16) * weight).sum(), leaves)
    keys = torch.cat([k for k, _ in past] + [own[0]])
    values = torch.cat([v for _, v in past] + [own[1]])
    want = torch.autograd.grad((reference(q, keys, values, scale, 3) * weight).sum(), leaves)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_block_partial_passes_gradcheck_with_a_mask() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(4, 1, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(4, 1, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = causal_mask(4, 4, 1, q.device)

    def out_and_lse(q, k, v):
        part = block_partial([(q, k)], v, 0.5, mask)
        return part.out, part.lse

    assert torch.autograd.gradcheck(out_and_lse, (q, k, v))


def test_merging_partials_equals_one_block_over_their_union() -> None:
    q, past, _ = random_case([5, 7], 2, seed=3)
    (k1, v1), (k2, v2) = past
    merged = merge(block_partial([(q, k1)], v1, 0.4), block_partial([(q, k2)], v2, 0.4))
    whole = block_partial([(q, torch.cat([k1, k2]))], torch.cat([v1, v2]), 0.4)
    torch.testing.assert_close(merged.out, whole.out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged.lse, whole.lse, rtol=1e-12, atol=1e-12)
