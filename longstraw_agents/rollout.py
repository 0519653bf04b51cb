"""The rollout loop: environments + a sampler → groups of token-exact trajectories, written to the store as each
group finishes (one transaction per group, so the store never holds part of a group).

A group is G episodes of the same task (same env seed). The sampler captures the shared prompt once and forks it
for the G members; each turn, a member's new tokens and the environment's observation extend its own state, so no
turn re-prefills the episode. All members of all groups of a call are played turn by turn in lockstep, so a sampler
that generates many members at once (``BatchSampler``: ``TorchSampler`` runs one forward per token for all of them)
gets the widest batch; other samplers (``OpenAISampler``) are asked member by member. An episode that would outgrow
the model's context is ended explicitly (finish reason ``"context_limit"``), never silently cut.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import gymnasium
import numpy as np

from longstraw_agents.envs import ContextPolicy, ToolEnv, unwrap_tool_env
from longstraw_agents.progress import progress_bar
from longstraw_agents.sampler import Generation, Sampler
from longstraw_agents.trajectory import Trajectory

EnvFactory = Callable[[], gymnasium.Env]


class EpisodeSink(Protocol):
    """Where ``rollout_groups`` writes each finished group: a ``Store``, or a wrapper with its ``add_episodes``."""

    def add_episodes(self, trajectories: list[Trajectory], run_id: str | None = None) -> list[int]: ...


class ContextLimitError(ValueError):
    """A task's prompt does not fit the model's context."""


@dataclass
class RolloutLimits:
    """max_context: the model's context length in tokens (None: unlimited); max_new_tokens per turn."""

    max_new_tokens: int
    max_context: int | None = None


def make_env_factory(env_id: str, env_kwargs: dict | None = None, limits: RolloutLimits | None = None) -> EnvFactory:
    """Environments of ``env_id``; with ``limits.max_context``, their budget never exceeds what the model's context
    allows (``model_budget``), so an observation that would not fit ends the episode in the env (finish reason
    "max_tokens") or, with a context policy, makes the env edit its context while a turn still fits."""
    kwargs = dict(env_kwargs or {})

    def factory() -> gymnasium.Env:
        env = gymnasium.make(env_id, **kwargs)
        if limits is None:
            return env
        tool_env = unwrap_tool_env(env)
        cap = model_budget(tool_env.context_policy, limits)
        if cap is None or context_budget(tool_env) <= cap:
            return env
        if tool_env.context_policy.max_context_tokens is None:  # the episode is the context: its budget is capped
            env.close()
            return gymnasium.make(env_id, **{**kwargs, "max_tokens": cap})
        tool_env.context_policy = _capped_policy(tool_env.context_policy, cap, limits)
        return env

    return factory


def model_budget(policy: ContextPolicy, limits: RolloutLimits) -> int | None:
    """The largest budget the model's context allows the env (None: unlimited). Without a context budget the budget
    is the whole episode's ``max_tokens``, turns included, so it may fill the context. A context policy's
    ``max_context_tokens`` bounds the context after an observation, before the next turn: it leaves room for that
    turn (``max_new_tokens``), else the turn after an edit that fills the budget is cut short."""
    if limits.max_context is None:
        return None
    if policy.max_context_tokens is None:
        return limits.max_context
    room = limits.max_context - limits.max_new_tokens
    if room < 1:
        raise ContextLimitError(
            f"max_new_tokens={limits.max_new_tokens} leaves no room for a context budget in the model's context "
            f"limit of {limits.max_context} tokens; lower sampling.max_new_tokens"
        )
    return room


def _capped_policy(policy: ContextPolicy, cap: int, limits: RolloutLimits) -> ContextPolicy:
    """``policy`` at the budget the model's context allows (any policy, built from the config or given as an
    object); one line naming the model's limit when the policy cannot work at it."""
    try:
        return policy.with_budget(cap)
    except ValueError as err:
        raise ContextLimitError(
            f"{err}, and the model's context limit of {limits.max_context} tokens (model.max_context or the model "
            f"config's max_position_embeddings) less a turn (max_new_tokens={limits.max_new_tokens}) caps "
            f"max_context_tokens={policy.max_context_tokens} at {cap}; lower the threshold or max_context_tokens"
        ) from None


def context_budget(env: ToolEnv) -> int:
    """The most tokens an episode's context holds: its context policy's budget, else the episode's."""
    budget = env.context_policy.max_context_tokens
    return env.config.max_tokens if budget is None else budget


def rollout_group(
    env_factory: EnvFactory,
    sampler: Sampler,
    group_size: int,
    seed: int,
    group_id: str,
    limits: RolloutLimits,
    on_episode: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Play ``group_size`` episodes of the task ``seed`` with ``sampler``; returns their trajectories."""
    members = start_group(env_factory, sampler, group_size, seed, group_id, limits)
    return play_until_done([m.env for m in members], [m.handle for m in members], sampler, limits, on_episode)


def start_group(
    env_factory: EnvFactory, sampler: Sampler, group_size: int, seed: int, group_id: str, limits: RolloutLimits
) -> list[_Member]:
    """``group_size`` environments reset to the task ``seed`` and the sampler's fork of their (shared) prompt."""
    envs = [unwrap_tool_env(env_factory()) for _ in range(group_size)]
    budget, cap = context_budget(envs[0]), model_budget(envs[0].context_policy, limits)
    if cap is not None and budget > cap:
        raise ValueError(
            f"{envs[0].env_id}: the environment's context budget={budget} exceeds the {cap} tokens the model's "
            f"max_context={limits.max_context} allows it (a context policy's budget leaves room for a turn of "
            f"max_new_tokens={limits.max_new_tokens}), so observations could overflow the context; build the envs "
            "with make_env_factory(env_id, kwargs, limits)"
        )
    options = {"group_id": group_id, "policy_version": sampler.policy_version}
    prompts = [reset_prompt(env, seed, options, limits) for env in envs]
    if any(not np.array_equal(p, prompts[0]) for p in prompts[1:]):
        raise RuntimeError(f"{envs[0].env_id}: reset(seed={seed}) gave different prompts; the env is not seeded")
    handles = sampler.fork(prompts[0].tolist(), group_size)
    return [_Member(env, handle) for env, handle in zip(envs, handles, strict=True)]


def reset_prompt(
    env: ToolEnv, seed: int, options: dict | None = None, limits: RolloutLimits | None = None
) -> np.ndarray:
    """``env.reset(seed=seed, options=options)``'s prompt. When the env's budget is what the model's context allows
    (capped by ``make_env_factory``), a prompt over it is a ContextLimitError that names the model's limit: the env's
    own advice, "raise max_tokens", would have no effect."""
    try:
        return env.reset(seed=seed, options=options)[0]
    except ValueError as err:
        cap = None if limits is None else model_budget(env.context_policy, limits)
        if limits is None or cap is None or context_budget(env) < cap:  # the env's own budget binds
            raise
        bounded = env.context_policy.max_context_tokens is not None
        room = f" less a turn (max_new_tokens={limits.max_new_tokens})" if bounded else ""
        raise ContextLimitError(
            f"{env.env_id}: the task's prompt does not fit the model's context limit of {limits.max_context} tokens"
            f"{room} (set by model.max_context or the model config's max_position_embeddings; it caps the env's "
            f"budget, so raising max_tokens has no effect). The environment said: {err}"
        ) from err


def play_until_done(
    envs: Sequence[ToolEnv],
    handles: Sequence[Any],
    sampler: Sampler,
    limits: RolloutLimits,
    on_episode: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Step every member (env + sampler handle, both at the same point of their episode) until all have ended,
    turn by turn in lockstep: each turn's generations are asked of the sampler at once (``generate_turn``)."""
    members = [_Member(env, handle) for env, handle in zip(envs, handles, strict=True)]
    end = None if on_episode is None else (lambda k: on_episode(members[k].env.trajectory))
    play_lockstep(members, sampler, limits, end)
    return [env.trajectory for env in envs]


@runtime_checkable
class BatchSampler(Sampler, Protocol):
    """A sampler that generates a turn of many members at once (``TorchSampler``: one forward per token for all)."""

    def generate_batch(self, handles: Sequence[Any], max_new_tokens: Sequence[int | None]) -> list[Generation]: ...


def generate_turn(sampler: Sampler, handles: Sequence[Any], budgets: Sequence[int]) -> list[Generation]:
    """One turn of each member: batched when the sampler can (``BatchSampler``), else member by member."""
    if isinstance(sampler, BatchSampler):
        return sampler.generate_batch(handles, list(budgets))
    return [sampler.generate(handle, budget) for handle, budget in zip(handles, budgets, strict=True)]


@dataclass
class _Member:
    env: ToolEnv
    handle: Any


def play_lockstep(
    members: Sequence[_Member],
    sampler: Sampler,
    limits: RolloutLimits,
    on_end: Callable[[int], None] | None = None,
    on_turn: Callable[[list[Generation]], None] | None = None,
) -> None:
    """Play ``members`` until all have ended: each turn, every live member generates (all at once), then each
    steps its env and extends its handle with the observation. ``on_end(k)`` runs when member k's episode ends
    (in member order within a turn); ``on_turn`` gets each turn's generations."""
    active = list(range(len(members)))
    while active:
        ended, ready, budgets = [], [], []
        for k in active:
            budget = _budget(members[k], sampler, limits)
            if budget <= 0:
                members[k].env.end_episode("context_limit")
                ended.append(k)
            else:
                ready.append(k)
                budgets.append(budget)
        generations = generate_turn(sampler, [members[k].handle for k in ready], budgets) if ready else []
        if on_turn is not None:
            on_turn(generations)
        active, edited = [], []
        for k, generation in zip(ready, generations, strict=True):
            step = _step(members[k], generation)
            if step is None:
                ended.append(k)
                continue
            active.append(k)
            observation, change = step
            if change is None:
                sampler.append(members[k].handle, observation)
            else:  # the env edited the context: the observation is the whole new context
                edited.append((members[k].handle, observation, int(change["kept_tokens"])))
        if edited:
            replace_contexts(sampler, edited)
        for k in sorted(ended):
            if on_end is not None:
                on_end(k)


def _budget(member: _Member, sampler: Sampler, limits: RolloutLimits) -> int:
    """Tokens the member may generate this turn: the turn limit, capped by the room left in the context."""
    if limits.max_context is None:
        return limits.max_new_tokens
    return min(limits.max_new_tokens, limits.max_context - sampler.num_tokens(member.handle))


def _step(member: _Member, generation: Generation) -> tuple[list[int], dict[str, Any] | None] | None:
    """Step the member's env with its generation: None when its episode ended, else the observation and the
    context edit the env reports (``info["context_edit"]``, None when it only appended)."""
    action: dict[str, Any] = {"token_ids": generation.token_ids, "logprobs": generation.logprobs}
    if generation.policy_version is not None:
        action["policy_version"] = generation.policy_version
    observation, _, terminated, truncated, info = member.env.step(action)
    if terminated or truncated:
        return None
    return observation.tolist(), info.get("context_edit")


@runtime_checkable
class BatchReplacer(Sampler, Protocol):
    """A sampler that captures several edited contexts at once, sharing what they have in common (``TorchSampler``)."""

    def replace_batch(self, handles: Sequence[Any], contexts: Sequence[Sequence[int]], kept: Sequence[int]) -> None: ...


def replace_contexts(sampler: Sampler, edited: Sequence[tuple[Any, list[int], int]]) -> None:
    """A turn's edited contexts (handle, new context, kept tokens): at once when the sampler can
    (``BatchReplacer``), else member by member."""
    if isinstance(sampler, BatchReplacer):
        handles, contexts, kept = zip(*edited, strict=True)
        sampler.replace_batch(handles, contexts, kept)
        return
    for handle, context, kept_tokens in edited:
        sampler.replace(handle, context, kept_tokens)


def rollout_groups(
    env_factory: EnvFactory,
    sampler: Sampler,
    seeds: Sequence[int],
    group_size: int,
    limits: RolloutLimits,
    *,
    group_prefix: str = "g",
    store: EpisodeSink | None = None,
    run_id: str | None = None,
    progress: bool = True,
    desc: str = "rollout",
) -> list[list[Trajectory]]:
    """One group per seed, all groups played together turn by turn (one wide batch for a batched sampler); each
    group is written to ``store`` (if given) in one transaction once all its members have finished, so a failure
    mid-group (server gone, Ctrl-C) leaves no partial group behind."""
    groups = [
        start_group(env_factory, sampler, group_size, seed, f"{group_prefix}{g}", limits)
        for g, seed in enumerate(seeds)
    ]
    members = [member for group in groups for member in group]
    finished: list[list[Trajectory]] = [[] for _ in groups]  # per group, in finishing order
    meter = _RolloutMeter(progress_bar(total=len(members), desc=desc, unit="ep", enabled=progress, leave=False))

    def on_end(k: int) -> None:
        g = k // group_size
        finished[g].append(members[k].env.trajectory)
        meter.episode(members[k].env.trajectory)
        if len(finished[g]) == group_size and store is not None:
            store.add_episodes(finished[g], run_id=run_id)

    try:
        play_lockstep(members, sampler, limits, on_end, meter.turn)
    finally:
        meter.close()
    return [[member.env.trajectory for member in group] for group in groups]


class _RolloutMeter:
    """The rollout's progress line: finished episodes, generated tokens per second and the mean reward so far."""

    def __init__(self, bar: Any):
        self.bar = bar
        self.started = time.perf_counter()
        self.tokens = 0
        self.rewards: list[float] = []

    def turn(self, generations: list[Generation]) -> None:
        self.tokens += sum(len(g.token_ids) for g in generations)
        self._show()

    def episode(self, trajectory: Trajectory) -> None:
        self.rewards.append(trajectory.reward or 0.0)
        self.bar.update(1)
        self._show()

    def _show(self) -> None:
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        reward = sum(self.rewards) / len(self.rewards) if self.rewards else float("nan")
        self.bar.set_postfix_str(f"{rate:,.0f} tok/s, reward {reward:.3f}", refresh=False)

    def close(self) -> None:
        self.bar.close()
