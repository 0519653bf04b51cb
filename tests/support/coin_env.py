"""``coin_env:LongStrawTest/Coin-v0``: the calculator scored by coin flips of the policy's own tokens, so that a
random-init policy gets mixed rewards (half its turns, on average, start with an even token id) and GRPO a real
gradient, without a warm start. Episodes run ``max_turns`` turns (a random policy never answers); the reward is the
share of turns whose first token id is even."""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np

from longstraw_agents.envs import EASY_CALCULATOR_KWARGS
from longstraw_agents.envs.calculator import CalculatorEnv

ENV_ID = "LongStrawTest/Coin-v0"
KWARGS: dict[str, Any] = {**EASY_CALCULATOR_KWARGS, "max_turns": 2}


class CoinEnv(CalculatorEnv):
    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        observation, reward, terminated, truncated, info = super().step(action)
        if terminated or truncated:
            trajectory = self.trajectory
            turns = [s for s in trajectory.segments if s.role == "assistant"]
            trajectory.reward = reward = sum(len(s) > 0 and int(s.token_ids[0]) % 2 == 0 for s in turns) / len(turns)
        return observation, reward, terminated, truncated, info


if ENV_ID not in gymnasium.registry:
    gymnasium.register(ENV_ID, entry_point=CoinEnv)
