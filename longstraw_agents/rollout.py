"""The rollout loop: environments + a sampler → groups of token-exact trajectories, written to the store as each
group finishes (one transaction per group, so the store never holds part of a group).

A group is G episodes of the same task (same env seed). The sampler captures the shared prompt once and forks it
for the G members; each turn, a member's new tokens and the environment's observation extend its own state, so no
turn re-prefills the episode. An episode that would outgrow the model's context is ended explicitly (finish
reason ``"context_limit"``), never silently cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import gymnasium
import numpy as np
from tqdm.auto import tqdm

from longstraw_agents.envs import ToolEnv, unwrap_tool_env
from longstraw_agents.sampler import Sampler
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


def make_env_factory(env_id: str, env_kwargs: dict | None = None, max_context: int | None = None) -> EnvFactory:
    """Environments of ``env_id``; with ``max_context``, their token budget never exceeds the model's context, so
    an observation that would not fit ends the episode in the env (finish reason "max_tokens")."""
    kwargs = dict(env_kwargs or {})

    def factory() -> gymnasium.Env:
        env = gymnasium.make(env_id, **kwargs)
        if max_context is not None and unwrap_tool_env(env).config.max_tokens > max_context:
            env.close()
            env = gymnasium.make(env_id, **{**kwargs, "max_tokens": max_context})
        return env

    return factory


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
    envs = [unwrap_tool_env(env_factory()) for _ in range(group_size)]
    if limits.max_context is not None and envs[0].config.max_tokens > limits.max_context:
        raise ValueError(
            f"{envs[0].env_id}: the environment's max_tokens={envs[0].config.max_tokens} exceeds the model's "
            f"max_context={limits.max_context}, so observations could overflow the context; build the envs with "
            "make_env_factory(env_id, kwargs, max_context)"
        )
    options = {"group_id": group_id, "policy_version": sampler.policy_version}
    prompts = [reset_prompt(env, seed, options, limits.max_context) for env in envs]
    if any(not np.array_equal(p, prompts[0]) for p in prompts[1:]):
        raise RuntimeError(f"{envs[0].env_id}: reset(seed={seed}) gave different prompts; the env is not seeded")
    handles = sampler.fork(prompts[0].tolist(), group_size)
    return play_until_done(envs, handles, sampler, limits, on_episode)


def reset_prompt(env: ToolEnv, seed: int, options: dict | None = None, max_context: int | None = None) -> np.ndarray:
    """``env.reset(seed=seed, options=options)``'s prompt. When the env's budget is the model's context (capped by
    ``make_env_factory``), a prompt over it is a ContextLimitError that names the model's limit: the env's own
    advice, "raise max_tokens", would have no effect."""
    try:
        return env.reset(seed=seed, options=options)[0]
    except ValueError as err:
        if max_context is None or env.config.max_tokens < max_context:
            raise
        raise ContextLimitError(
            f"{env.env_id}: the task's prompt does not fit the model's context limit of {max_context} tokens (set by "
            "model.max_context or the model config's max_position_embeddings; it caps the env's max_tokens, so "
            f"raising max_tokens has no effect). The environment said: {err}"
        ) from err


def play_until_done(
    envs: Sequence[ToolEnv],
    handles: Sequence[Any],
    sampler: Sampler,
    limits: RolloutLimits,
    on_episode: Callable[[Trajectory], None] | None = None,
) -> list[Trajectory]:
    """Step every member (env + sampler handle, both at the same point of their episode) until all have ended."""
    active = list(range(len(envs)))
    while active:
        still = []
        for k in active:
            if _play_turn(envs[k], sampler, handles[k], limits):
                if on_episode is not None:
                    on_episode(envs[k].trajectory)
            else:
                still.append(k)
        active = still
    return [env.trajectory for env in envs]


def _play_turn(env: ToolEnv, sampler: Sampler, handle: Any, limits: RolloutLimits) -> bool:
    """One assistant turn of one member; True when its episode ended."""
    budget = limits.max_new_tokens
    if limits.max_context is not None:
        budget = min(budget, limits.max_context - sampler.num_tokens(handle))
        if budget <= 0:
            env.end_episode("context_limit")
            return True
    generation = sampler.generate(handle, budget)
    action = {"token_ids": generation.token_ids, "logprobs": generation.logprobs}
    observation, _, terminated, truncated, _ = env.step(action)
    if terminated or truncated:
        return True
    sampler.append(handle, observation.tolist())
    return False


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
) -> list[list[Trajectory]]:
    """One group per seed; each group is written to ``store`` (if given) in one transaction once all its members
    have finished, so a failure mid-group (server gone, Ctrl-C) leaves no partial group behind."""
    groups = []
    bar = tqdm(total=len(seeds) * group_size, desc="rollout", unit="ep", disable=not progress, leave=False)
    try:
        for g, seed in enumerate(seeds):
            finished: list[Trajectory] = []  # in finishing order, as episode ids were before

            def on_episode(trajectory: Trajectory, finished: list[Trajectory] = finished) -> None:
                bar.update(1)
                finished.append(trajectory)

            group_id = f"{group_prefix}{g}"
            groups.append(rollout_group(env_factory, sampler, group_size, seed, group_id, limits, on_episode))
            if store is not None:
                store.add_episodes(finished, run_id=run_id)
    finally:
        bar.close()
    return groups
