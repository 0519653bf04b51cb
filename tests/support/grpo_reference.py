"""A plain GRPO reference for the trainer's tests, written from the formula in TRL's layout.

Nothing here imports the trainer or its loss module: log-probabilities come from one full forward per member
(transformers' own ``model(ids).logits`` or, where transformers' internal fp32 casts would cap fp64 agreement near
1e-7, the engine's full-sequence forward from an empty state), and the loss is computed the way TRL's
``GRPOTrainer._compute_loss`` does it — padded ``[G, L]`` tensors, a completion mask, then one of the three
reductions. The trainer instead weights members and sums per tree node, so agreement checks both the formula and
the bookkeeping.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from longstraw_agents.models.presets import forward_with_cache, returned_cache

ADVANTAGE_EPS = 1e-4  # TRL: (r - mean) / (std + 1e-4)

# ids [n] -> logits [n, V]: row t holds the logits that predict token t + 1
LogitsFn = Callable[[Tensor], Tensor]


def transformers_logits(model: nn.Module) -> LogitsFn:
    return lambda ids: model(ids.unsqueeze(0)).logits[0]


def engine_logits(engine) -> LogitsFn:
    """The engine's full-sequence forward (one graph, no captured prefix): exact in fp64."""
    return lambda ids: engine.logits(engine.empty_state(), ids)


def target_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)(target) per row, computed in float64 from logits of any dtype."""
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def sequence_logprobs(logits_fn: LogitsFn, ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log p(ids[t] | ids[:t]) for t = 1..n-1, over one full graph."""
    return target_logprobs(logits_fn(ids[:-1]), ids[1:], temperature)


def detached_prompt_logprobs(model: nn.Module, prompt: Tensor, completion: Tensor) -> Tensor:
    """log p of the completion's tokens with the prompt's contribution treated as a constant.

    The prompt's first P-1 tokens go through transformers' ``DynamicCache`` under ``no_grad``; the last prompt token
    and the completion (the inputs that predict the completion) run under autograd from a private deep copy of that
    cache, so gradients reach the parameters only through the completion's own positions. This is the trainer's
    target convention: the node predicting completion token 0 is fed the last prompt token.
    """
    with torch.no_grad():
        cache = returned_cache(model(prompt[:-1].unsqueeze(0), use_cache=True))
    inputs = torch.cat([prompt[-1:], completion[:-1]])
    logits = forward_with_cache(model, inputs.unsqueeze(0), copy.deepcopy(cache)).logits[0]
    return target_logprobs(logits, completion)


def advantages(rewards: Sequence[float], scale: bool = True) -> Tensor:
    r = torch.tensor(rewards, dtype=torch.float64)
    centred = r - r.mean()
    return centred / (r.std() + ADVANTAGE_EPS) if scale else centred


@dataclass(frozen=True)
class Reference:
    """The reference loss of a group (a graph to backpropagate) and its mean KL over the loss tokens."""

    loss: Tensor
    kl: float | None


def grpo_loss(
    logps: Sequence[Tensor],
    masks: Sequence[Tensor],
    rewards: Sequence[float],
    *,
    old_logps: Sequence[Tensor | None] | None = None,
    ref_logps: Sequence[Tensor] | None = None,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    aggregation: str = "token-mean",
    max_completion_length: int | None = 512,
    scale_rewards: bool = True,
    use_bias_correction_kl: bool = True,
    importance: str = "ratio",
    tis_cap: float = 2.0,
    episodes: Sequence[int] | None = None,
) -> Reference:
    """TRL's GRPO loss over member rows (each row: log-probs of a member's targets, mask says which carry loss).

    old_logps: behaviour log-probs per row (None: on-policy, ``logp.detach()``); only masked entries are read.
    aggregation: "token-mean" (TRL's "bnpo"/"dapo": Σ loss / Σ mask), "seq-mean" (TRL's "grpo": mean over members
    of each member's token mean), "dr-grpo" (TRL's "dr_grpo": Σ loss / (G · L), L = max_completion_length, TRL
    1.16's default 512; None: the longest member).
    use_bias_correction_kl: TRL 1.16's default, the k3 term times the differentiable ratio ``coef_1``.
    importance: "ratio" (behaviour log-probs are the ratio's denominator) or "tis" (verl's truncated importance
    sampling: the ratio is on-policy and each token is weighted by min(π/μ, tis_cap), π/μ detached).
    episodes: the episode (index into ``rewards``) of each row, when an episode is several rows (the physical
    sequences of an agent that edited its context): the episode is the sample, its rows share its advantage and the
    aggregation counts its masked tokens over all its rows. Default: row i is episode i.
    """
    logp = pad_sequence(list(logps), batch_first=True)
    mask = pad_sequence([m.to(torch.float64) for m in masks], batch_first=True)
    old = logp.detach().clone()
    if old_logps is not None:
        for row, (lp, m) in enumerate(zip(old_logps, masks, strict=True)):
            if lp is not None:
                old[row, : len(lp)] = torch.where(m.bool(), lp.to(torch.float64), old[row, : len(lp)])
    owner = torch.arange(len(rewards)) if episodes is None else torch.tensor(list(episodes))
    adv = advantages(rewards, scale_rewards)[owner].unsqueeze(1)
    tis_weight = torch.ones_like(old)
    if importance == "tis":
        tis_weight = torch.clamp(torch.exp(logp.detach() - old), max=tis_cap)
        old = logp.detach()

    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon, 1 + (epsilon if epsilon_high is None else epsilon_high))
    per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv) * tis_weight
    kl = None
    if beta > 0.0:
        ref = pad_sequence([r.to(torch.float64) for r in ref_logps], batch_first=True)
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
        corrected = per_token_kl * coef_1 if use_bias_correction_kl else per_token_kl
        per_token_loss = per_token_loss + beta * corrected
        kl = float((per_token_kl.detach() * mask).sum() / mask.sum())

    # per episode: its masked loss and its masked tokens, summed over its rows
    episode_loss = torch.zeros(len(rewards), dtype=torch.float64).index_add(0, owner, (per_token_loss * mask).sum(-1))
    episode_tokens = torch.zeros(len(rewards), dtype=torch.float64).index_add(0, owner, mask.sum(-1))
    if aggregation == "token-mean":
        loss = episode_loss.sum() / episode_tokens.sum()
    elif aggregation == "seq-mean":
        loss = (episode_loss / episode_tokens).mean()
    elif aggregation == "dr-grpo":
        length = max_completion_length or int(episode_tokens.max())
        loss = episode_loss.sum() / (len(rewards) * length)
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}")
    return Reference(loss=loss, kl=kl)


def parameter_grads(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter's gradient by name (zeros where autograd left none: an unrouted expert, an indexer)."""
    return {
        name: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in model.named_parameters()
    }


def flat(grads: dict[str, Tensor]) -> Tensor:
    return torch.cat([grads[name].flatten().double() for name in sorted(grads)])


def relative_l2(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    a, e = flat(actual), flat(expected)
    return float((a - e).norm() / e.norm())
