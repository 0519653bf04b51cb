"""Log-probabilities of target tokens straight from hidden states, in token x vocabulary tiles: no [n, V] tensor.

A 16K-token reasoning turn of a model with a 248K vocabulary has 16 GB of fp32 logits before the softmax. The LM
head and the log-softmax are fused here (as Liger's and TRL's chunked losses do): forward walks tiles of at most
``max_tile_elements`` logits, keeping a running log-sum-exp per row, and gathers each row's target logit from its
own weight row; it saves the hidden states, the targets and the log normalisers. Backward recomputes each tile's
probabilities with the saved normaliser and accumulates the gradients of the hidden states and of the head's weight
(and bias) tile by tile. Logits are computed in at least fp32 (fp64 for fp64 models), as the trainer's log-probs
always were.

    logp = head_logprobs(hidden [n, H], weight [V, H], targets [n], bias=None, temperature=1.0)  # [n]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

DEFAULT_TILE_ELEMENTS = 1 << 22  # logits materialised at once (16 MiB in fp32)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _tiles(n: int, vocab: int, max_tile_elements: int) -> tuple[int, int]:
    """(rows, vocab entries) per tile: whole rows when they fit, else 1,024-row slabs over vocabulary slices."""
    rows = max(1, min(n, max_tile_elements // max(vocab, 1)))
    if rows >= min(n, 1024):
        return rows, vocab
    rows = min(n, 1024)
    return rows, max(1, max_tile_elements // rows)


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, lo: int, hi: int, temperature: float) -> Tensor:
    """One tile of logits ``[rows, hi - lo]`` (a fresh tensor: callers may work on it in place)."""
    tile = h @ weight[lo:hi].to(h.dtype).T
    if bias is not None:
        tile.add_(bias[lo:hi].to(h.dtype))
    return tile.div_(temperature) if temperature != 1.0 else tile


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        max_tile_elements: int,
    ) -> Tensor:
        dt = compute_dtype(hidden.dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, cols = _tiles(n, vocab, max_tile_elements)
        lse = torch.empty(n, dtype=dt, device=hidden.device)
        for r0 in range(0, n, rows):
            h = hidden[r0 : r0 + rows].to(dt)
            running = None
            for c0 in range(0, vocab, cols):
                part = torch.logsumexp(_logits(h, weight, bias, c0, c0 + cols, temperature), dim=-1)
                running = part if running is None else torch.logaddexp(running, part)
            assert running is not None
            lse[r0 : r0 + rows] = running
        picked = (hidden.to(dt) * weight[targets].to(dt)).sum(-1)
        if bias is not None:
            picked = picked + bias[targets].to(dt)
        picked = picked / temperature if temperature != 1.0 else picked
        ctx.save_for_backward(hidden, weight, *(() if bias is None else (bias,)), targets, lse)
        ctx.has_bias, ctx.temperature, ctx.max_tile_elements = bias is not None, temperature, max_tile_elements
        return picked - lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, *rest = ctx.saved_tensors
        bias = rest.pop(0) if ctx.has_bias else None
        targets, lse = rest
        dt, temperature = lse.dtype, ctx.temperature
        n, vocab = hidden.shape[0], weight.shape[0]
        rows, cols = _tiles(n, vocab, ctx.max_tile_elements)
        g = grad.to(dt) / temperature  # d logp / d logits = onehot(target) - softmax, each over the temperature
        d_hidden = g.unsqueeze(-1) * weight[targets].to(dt)
        d_weight = None  # (a frozen head, as a LoRA policy's: no [V, H] gradient and no product for it)
        if ctx.needs_input_grad[1]:
            d_weight = torch.zeros(weight.shape, dtype=dt, device=weight.device)
            d_weight.index_add_(0, targets, g.unsqueeze(-1) * hidden.to(dt))
        d_bias = None
        if bias is not None:
            d_bias = torch.zeros(bias.shape, dtype=dt, device=bias.device).index_add_(0, targets, g)
        for r0 in range(0, n, rows):
            h, g_rows = hidden[r0 : r0 + rows].to(dt), g[r0 : r0 + rows].unsqueeze(-1)
            for c0 in range(0, vocab, cols):
                # the softmax part of d logp / d logits, in place in the tile (one tile-sized tensor alive)
                d_logits = _logits(h, weight, bias, c0, c0 + cols, temperature)
                d_logits.sub_(lse[r0 : r0 + rows, None]).exp_().mul_(g_rows)
                d_hidden[r0 : r0 + rows] -= d_logits @ weight[c0 : c0 + cols].to(dt)
                if d_weight is not None:
                    d_weight[c0 : c0 + cols] -= d_logits.T @ h
                if d_bias is not None:
                    d_bias[c0 : c0 + cols] -= d_logits.sum(0)
        return (
            d_hidden.to(hidden.dtype),
            None if d_weight is None else d_weight.to(weight.dtype),
            None if d_bias is None or bias is None else d_bias.to(bias.dtype),
            None,
            None,
            None,
        )


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    max_tile_elements: int = DEFAULT_TILE_ELEMENTS,
) -> Tensor:
    """``log_softmax((hidden @ weightᵀ + bias) / temperature)[target]`` per row ``[n]``, in at least fp32,
    differentiable in ``hidden``, ``weight`` and ``bias``, with at most ``max_tile_elements`` logits alive at once."""
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [n, H] and targets [n]; got {tuple(hidden.shape)} and {tuple(targets.shape)}")
    if max_tile_elements < 1:
        raise ValueError(f"max_tile_elements must be >= 1, got {max_tile_elements}")
    logp: Tensor = _HeadLogprobs.apply(hidden, weight, bias, targets, temperature, max_tile_elements)
    return logp
