"""Supervised warm start: next-token cross-entropy on the loss-masked (assistant) tokens of trajectories.

A tiny random-init policy cannot discover a tool-call format by exploration; a short warm start on a reference
policy's traces (e.g. an environment's scripted policy) gives GRPO something to improve.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from longstraw_agents.progress import progress_bar
from longstraw_agents.trajectory import Trajectory


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(100, ge=0, description="optimizer steps")
    batch_size: int = Field(8, ge=1, description="trajectories per step")
    lr: float = Field(3e-3, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float | None = Field(1.0, gt=0.0)
    seed: int = 0


def masked_nll(model: nn.Module, trajectories: Sequence[Trajectory]) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over the trajectories' loss tokens, and their count, in one forward.

    A row per physical sequence (one per trajectory unless it edited its context: each token is learned in the
    context it was written in). The rows are right-padded into one batch: under the causal mask a real token never
    attends to the padding after it, so its logits are those of the sequence alone, and padded positions carry no
    loss."""
    rendered = [t.render_sequence(sequence) for t in trajectories for sequence in t.physical_sequences()]
    width = max(len(r.token_ids) for r in rendered) - 1
    ids = torch.zeros((len(rendered), width + 1), dtype=torch.long)
    mask = torch.zeros((len(rendered), width), dtype=torch.bool)
    for row, r in enumerate(rendered):
        ids[row, : len(r.token_ids)] = torch.as_tensor(r.token_ids, dtype=torch.long)
        mask[row, : len(r.token_ids) - 1] = torch.as_tensor(r.loss_mask[1:], dtype=torch.bool)
    # logits only at the positions where some row has loss (the prompts are most of a batch), then those rows' loss
    # tokens: [tokens, V]. A position list is what every transformers 5 takes as logits_to_keep (a boolean mask only
    # from 5.21).
    kept = mask.any(dim=0).nonzero()[:, 0]
    logits = model(ids[:, :-1], logits_to_keep=kept).logits[mask[:, kept]]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 models: the softmax in fp32
    nll = torch.nn.functional.cross_entropy(logits, ids[:, 1:][mask], reduction="sum")
    return nll, int(mask.sum())


def supervised_warm_start(
    model: nn.Module,
    trajectories: Sequence[Trajectory],
    config: SFTConfig | None = None,
    on_step: Callable[[int, float], None] | None = None,
    progress: bool | None = None,
    label: str = "warm start",
) -> list[float]:
    """Train on ``trajectories`` (token-mean NLL per batch); returns the loss of each step.

    label: the progress bar's name.
    progress: a bar with the loss and tokens per second (plain lines when standard error is not a terminal; None:
    the bar on a terminal only, ``longstraw_agents.progress``)."""
    config = config or SFTConfig()
    if not trajectories:
        raise ValueError("no trajectories to warm-start on")
    rng = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    model.train()
    losses: list[float] = []
    with fused_attention(model):
        bar = progress_bar(total=config.steps, desc=label, unit="step", enabled=progress)
        started, tokens = time.perf_counter(), 0
        try:
            for step in range(config.steps):
                batch = [trajectories[rng.randrange(len(trajectories))] for _ in range(config.batch_size)]
                optimizer.zero_grad(set_to_none=True)
                total, count = masked_nll(model, batch)
                tokens += sum(trajectory.num_tokens for trajectory in batch)
                loss = total / max(count, 1)
                loss.backward()
                if config.max_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
                optimizer.step()
                losses.append(float(loss.detach()))
                rate = tokens / max(time.perf_counter() - started, 1e-9)
                bar.set_postfix_str(f"loss {losses[-1]:.3f}, {rate:,.0f} tok/s", refresh=False)
                bar.update(1)
                if on_step is not None:
                    on_step(step, losses[-1])
        finally:
            bar.close()
    model.eval()
    return losses


@contextmanager
def fused_attention(model: nn.Module) -> Iterator[None]:
    """A model built with eager attention runs torch's fused SDPA while the block runs, where transformers offers it
    for the family. The warm start's forwards are whole physical sequences of thousands of tokens: eager attention
    keeps their [heads, T, T] probabilities for the backward (8.6 GB and 8x the time for one PageRecall episode).
    The rows are right-padded and no mask is passed, so SDPA runs causal, as eager does. Any other implementation
    (flash, flex, a kernel) is left as it is."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "eager" or getattr(config, "sub_configs", None):
        yield  # not eager, or a composite model whose parts may differ: nothing to switch back to
        return
    try:
        model.set_attn_implementation("sdpa")  # type: ignore[operator]
    except (AttributeError, ValueError, ImportError):  # no such switch, or no SDPA for this family
        yield
        return
    try:
        yield
    finally:
        model.set_attn_implementation("eager")  # type: ignore[operator]
