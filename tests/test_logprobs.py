"""Target log-probabilities from hidden states in tiles (logprobs.py) equal the untiled log-softmax of the LM head's
logits — values and gradients of hidden states, weight and bias, fp64 — without ever holding [n, V] logits."""

from __future__ import annotations

import pytest
import torch

from longstraw_agents.logprobs import head_logprobs
from longstraw_agents.memory import MemoryTracker


def untiled(hidden, weight, targets, bias=None, temperature=1.0):
    logits = hidden @ weight.T + (0.0 if bias is None else bias)
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(("n", "vocab", "tile"), [(7, 11, 5), (33, 50, 64), (5, 40, 1 << 22), (1, 3, 1)])
def test_tiled_logprobs_and_gradients_equal_the_untiled_ones(n, vocab, tile, with_bias) -> None:
    gen = torch.Generator().manual_seed(n * vocab)
    hidden = torch.randn(n, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(vocab, dtype=torch.float64, generator=gen, requires_grad=True) if with_bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    leaves = [hidden, weight] + ([bias] if bias is not None else [])
    got = head_logprobs(hidden, weight, targets, bias, temperature=0.7, max_tile_elements=tile)
    want = untiled(hidden, weight, targets, bias, temperature=0.7)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(n, dtype=torch.float64, generator=gen)
    for g, w in zip(
        torch.autograd.grad((got * upstream).sum(), leaves),
        torch.autograd.grad((want * upstream).sum(), leaves),
        strict=True,
    ):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_gradcheck() -> None:
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(4, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(9, 3, dtype=torch.float64, generator=gen, requires_grad=True)
    targets = torch.tensor([0, 8, 3, 3])
    assert torch.autograd.gradcheck(lambda h, w: head_logprobs(h, w, targets, max_tile_elements=7), (hidden, weight))


def test_no_tensor_of_all_logits_is_ever_alive() -> None:
    n, vocab, width = 2048, 8192, 32
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(n, width, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, width, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (n,), generator=gen)
    full_logits = n * vocab * 4
    with MemoryTracker() as tracker:
        head_logprobs(hidden, weight, targets, max_tile_elements=1 << 18).sum().backward()
    # tiles of 2^18 fp32 logits, plus the weight-sized gradient (what autograd hands the parameter anyway)
    assert tracker.peak_bytes <= full_logits / 16 + weight.numel() * 4 * 3


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="hidden must be"):
        head_logprobs(torch.zeros(3, 2), torch.zeros(5, 2), torch.zeros(2, dtype=torch.long))
