"""Policies that drive a `ToolEnv` without a model: the scripted oracle, and the episode loop that runs one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium
import numpy as np

from longstraw_agents.trajectory import Trajectory

from .base import Action, ToolEnv

Policy = Callable[[np.ndarray], Action]
"""Maps the latest observation (token ids) to the next action (the token ids of one assistant turn)."""


def unwrap_tool_env(env: gymnasium.Env) -> ToolEnv[Any]:
    """The `ToolEnv` under any wrappers (``gymnasium.make`` adds some)."""
    inner = env.unwrapped
    if not isinstance(inner, ToolEnv):
        raise TypeError(f"expected a LongStraw ToolEnv (possibly wrapped), got {type(inner).__name__}")
    return inner


class ScriptedPolicy:
    """The reference solution of an environment, played turn by turn.

    It is an oracle: it reads the env's hidden task and plays ``env.scripted_turns(task)``, encoded as a policy
    would emit them (special tokens allowed, ``<|im_end|>`` appended), and ``env.scripted_summary`` when the
    context policy asks for a reply (a summary). Used by ``make demo``, for supervised warm
    starts and in tests; it ignores the observations, because the script already knows every answer.
    """

    def __init__(self, env: gymnasium.Env) -> None:
        self.env = unwrap_tool_env(env)

    def act(self, observation: np.ndarray | None = None) -> np.ndarray:
        env = self.env
        turns = env.scripted_turns(env.task)
        played = env.turn - env.context_replies  # replies to the context policy are not in the script
        if env.awaiting_context_reply:
            return env.formatter.assistant(env.scripted_summary(env.task, played), env.turn).token_ids.astype(np.int64)
        if played >= len(turns):
            raise RuntimeError(
                f"{env.env_id}: the script has {len(turns)} turns and the episode is at turn {env.turn}; "
                "the episode should have ended (is max_turns too small for the script?)"
            )
        return env.formatter.assistant(turns[played], env.turn).token_ids.astype(np.int64)

    __call__ = act


def run_episode(
    env: gymnasium.Env, policy: Policy, seed: int | None = None, options: dict[str, Any] | None = None
) -> Trajectory:
    """Reset ``env`` with ``seed``, step ``policy`` until the episode ends, and return its trajectory."""
    observation, _ = env.reset(seed=seed, options=options)
    while True:
        observation, _, terminated, truncated, _ = env.step(policy(observation))
        if terminated or truncated:
            return unwrap_tool_env(env).trajectory
