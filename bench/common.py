"""Shared pieces of the trainer benchmarks: the model, synthetic groups, timing and the PrefixGrouper baseline."""

from __future__ import annotations

import torch

from longstraw_agents.engine import Engine
from longstraw_agents.models.base import LayerContext
from longstraw_agents.models.presets import TINY_PRESETS, build_model
from longstraw_agents.trainer.loss import AGGREGATIONS, GRPOLoss, LossConfig, group_advantages, token_logprobs

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


def prefix_grouper_backward(engine: Engine, prompt, completions, rewards, config: LossConfig | None = None) -> float:
    """PrefixGrouper-style baseline: the shared prefix once WITH a full autograd graph, every completion attending
    to it, one backward. Same loss as the trainer's token-mean GRPO (on-policy)."""
    config = config or LossConfig()
    adapter = engine.adapter
    layers = adapter.layers
    _, new = adapter.forward(prompt[:-1], 0, [LayerContext() for _ in layers])
    contexts = [
        LayerContext(past=[entry]) if layer.mixer.grows else LayerContext(recurrent=entry)
        for layer, entry in zip(layers, new, strict=True)
    ]
    advantages = group_advantages(rewards, config.scale_rewards).tolist()
    weights = AGGREGATIONS[config.aggregation].weights([len(c) for c in completions], config)
    objective = GRPOLoss.from_config(config)
    total = None
    for completion, advantage, weight in zip(completions, advantages, weights, strict=True):
        inputs = torch.cat([prompt[-1:], completion[:-1]])
        hidden, _ = adapter.forward(inputs, prompt.shape[0] - 1, contexts)
        logp = token_logprobs(adapter.lm_head(hidden), completion).double()
        per_token, _ = objective(logp, advantage)
        loss = per_token.sum() * weight
        total = loss if total is None else total + loss
    total.backward()
    return float(total.detach())


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])
