"""The GRPO backward of one group, the trainer's public functions:

- ``backward_group(engine, group, mode)``: a built ``Group`` (``trainer.group``) through one execution mode
  (``trainer.modes``);
- ``grpo_backward(model, prompt_ids, completions, rewards, mode)``: G completions of one prompt;
- ``grpo_backward_trajectories(model, trajectories, rewards, mode)``: whole multi-turn trajectories (the tree form).

Each accumulates into ``param.grad`` and returns a ``BackwardResult``; none steps an optimizer.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from torch import Tensor, nn

from longstraw_agents.engine import Engine
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.token_ids import TokenIds
from longstraw_agents.trainer.group import Group, completion_members, make_group, token_array, trajectory_group
from longstraw_agents.trainer.loss import LossConfig
from longstraw_agents.trainer.metrics import BackwardResult
from longstraw_agents.trainer.modes import MODES, ModeName, PrefixCache
from longstraw_agents.trajectory import Trajectory


def backward_group(
    engine: Engine,
    group: Group,
    mode: ModeName = "exact",
    config: LossConfig | None = None,
    ref_engine: Engine | None = None,
    track_memory: bool = False,
    prefix_cache: PrefixCache | None = None,
) -> BackwardResult:
    """Accumulate the group's GRPO gradient into ``param.grad`` with the chosen execution mode.

    prefix_cache: detached mode only; keeps the context states of this call for later calls on the same group
    (exact now, approximate once the weights changed: ``trainer.modes.PrefixCache``)."""
    config = config or LossConfig()
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {sorted(MODES)}")
    runner = MODES[mode](engine, config, ref_engine, prefix_cache)
    tracker = MemoryTracker() if track_memory else None
    start = time.perf_counter()
    if tracker is not None:
        with tracker:
            walk = runner.run(group)
    else:
        walk = runner.run(group)
    loss, kl = walk.sums.reduce()
    return BackwardResult(
        loss=loss,
        mode=mode,
        num_members=len(group.rewards),
        loss_tokens=group.num_loss_tokens,
        unique_tokens=group.tree.num_unique_tokens,
        forward_tokens=walk.forward_tokens,
        nodes=walk.nodes,
        peak_bytes=tracker.peak_bytes if tracker is not None else None,
        seconds=time.perf_counter() - start,
        advantages=tuple(group.advantages()),
        rewards=tuple(group.rewards),
        kl=kl,
        sequences=len(group.members),
        sequence_tokens=sum(len(m) for m in group.members),
    )


def _engines(
    model: nn.Module | Engine, ref_model: nn.Module | Engine | None, chunk_size: int | None
) -> tuple[Engine, Engine | None]:
    """The policy's engine and the reference's (None without a reference); a given ``Engine`` is used as is."""

    def engine_for(module: nn.Module | Engine) -> Engine:
        if isinstance(module, Engine):
            return module
        return Engine(module, chunk_size=chunk_size) if chunk_size else Engine(module)

    return engine_for(model), engine_for(ref_model) if ref_model is not None else None


def grpo_backward(
    model: nn.Module | Engine,
    prompt_ids: TokenIds,
    completions: Sequence[TokenIds],
    rewards: Sequence[float],
    mode: ModeName = "exact",
    *,
    config: LossConfig | None = None,
    old_logprobs: Sequence[Sequence[float] | Tensor | None] | None = None,
    ref_model: nn.Module | Engine | None = None,
    chunk_size: int | None = None,
    track_memory: bool = False,
) -> BackwardResult:
    """GRPO gradient of one group sharing ``prompt_ids``, accumulated into ``param.grad``.

    completions: G 1-D token tensors; rewards: G floats; old_logprobs: optional behaviour log-probs per completion
    (on-policy when omitted). Returns the loss, token counts, ``peak_bytes`` (tracked tensor bytes) and
    ``prompt_tokens``.
    """
    config = config or LossConfig()
    prompt = token_array(prompt_ids, "prompt_ids")
    members = completion_members(prompt, completions, old_logprobs)
    engine, ref_engine = _engines(model, ref_model, chunk_size)
    group = make_group(members, rewards, config)
    result = backward_group(engine, group, mode, config, ref_engine, track_memory)
    return dataclasses.replace(result, prompt_tokens=int(prompt.size))


def grpo_backward_trajectories(
    model: nn.Module | Engine,
    trajectories: Sequence[Trajectory],
    rewards: Sequence[float] | None = None,
    mode: ModeName = "exact",
    *,
    config: LossConfig | None = None,
    ref_model: nn.Module | Engine | None = None,
    chunk_size: int | None = None,
    track_memory: bool = False,
) -> BackwardResult:
    """The tree form: whole multi-turn trajectories (loss masks and behaviour logprobs from the segments; rewards
    from ``rewards`` or each trajectory's own)."""
    config = config or LossConfig()
    group = trajectory_group(trajectories, rewards, config)
    engine, ref_engine = _engines(model, ref_model, chunk_size)
    return backward_group(engine, group, mode, config, ref_engine, track_memory)
