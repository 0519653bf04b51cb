"""Shared pieces of the trainer benchmarks: the model, synthetic groups and gradient helpers. The peers the trainer
bench compares against (the real PrefixGrouper, a per-member SDPA graph) live in ``bench/peers.py``."""

from __future__ import annotations

import torch

from longstraw_agents.models.presets import TINY_PRESETS, build_model

VOCAB = 2048


def bench_model(family: str = "llama", hidden: int = 128, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    return build_model(TINY_PRESETS[family](vocab_size=VOCAB, hidden=hidden, layers=layers), seed=seed)


def synthetic_group(prompt_len: int, group: int, completion_len: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (prompt_len,), generator=gen)
    completions = [torch.randint(0, VOCAB, (completion_len,), generator=gen) for _ in range(group)]
    rewards = torch.rand(group, generator=gen).tolist()
    return prompt, completions, rewards


def materialise_grads(model: torch.nn.Module) -> None:
    """Allocate .grad before measuring, so that peak tracked bytes exclude the (mode-independent) param grads."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


VANISHING = 1e-8
"""An exact gradient norm below this is rounding: the policy's samples all carry (numerically) certain tokens."""


def compare(detached: torch.Tensor, exact: torch.Tensor) -> tuple[float, float] | None:
    """Cosine and relative L2 distance of the detached gradient to the exact one; None where the exact one vanishes
    (its norm at most `VANISHING`)."""
    norm = exact.norm()
    if norm <= VANISHING:
        return None
    cosine = torch.nn.functional.cosine_similarity(detached, exact, dim=0)
    return float(cosine), float((detached - exact).norm() / norm)
