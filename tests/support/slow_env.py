"""``slow_env:LongStrawTest/SlowCalculator-v0``: the calculator whose first step of some tasks takes a while, as a
slow tool call would (a random-init policy makes no real tool calls). ``pauses`` maps a task seed to the seconds its
first step takes, once per process: a group of that task is slow once, on the rank that rolls it out. The multinode
tests put this module on the workers' path."""

from __future__ import annotations

import time
from typing import Any

import gymnasium
import numpy as np
from pydantic import Field

from longstraw_agents.envs.calculator import CalculatorConfig, CalculatorEnv

ENV_ID = "LongStrawTest/SlowCalculator-v0"

_paused: set[int] = set()  # the task seeds this process has paused on


class SlowCalculatorConfig(CalculatorConfig):
    pauses: dict[int, float] = Field(default_factory=dict, description="Task seed -> seconds of its first step.")


class SlowCalculatorEnv(CalculatorEnv):
    config_class = SlowCalculatorConfig
    config: SlowCalculatorConfig

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        self._seed = seed
        return super().reset(seed=seed, options=options)

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        seed = self._seed
        if seed is not None and seed in self.config.pauses and seed not in _paused:
            _paused.add(seed)
            time.sleep(self.config.pauses[seed])
        return super().step(action)


gymnasium.register(ENV_ID, entry_point=SlowCalculatorEnv)
