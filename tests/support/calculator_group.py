"""A fixed Calculator group for learning tests: G scripted episodes of one task, half solved, half answered wrongly,
sharing the prompt, the tool call and its result; and each member's log-likelihood under a model."""

from __future__ import annotations

import gymnasium
import numpy as np
import torch

from longstraw_agents.envs import EASY_CALCULATOR_KWARGS, ScriptedPolicy, run_episode, unwrap_tool_env
from longstraw_agents.trajectory import Trajectory

G = 8


class WrongAnswerPolicy(ScriptedPolicy):
    """The scripted solution with a wrong final answer (off by ``offset``): the env scores it 0."""

    def __init__(self, env: gymnasium.Env, offset: int) -> None:
        super().__init__(env)
        self.offset = offset

    def act(self, observation: np.ndarray | None = None) -> np.ndarray:
        env = self.env
        if env.turn < len(env.scripted_turns(env.task)) - 1:
            return super().act(observation)
        return env.formatter.assistant(f"<answer>{env.task.answer + self.offset}</answer>", env.turn).token_ids

    __call__ = act


def calculator_group(seed: int = 3) -> tuple[list[Trajectory], int]:
    """One task, G episodes: half solved by the script, half with a wrong answer; they share the prompt, the tool
    call and its result, and diverge at the answer. Also the tokenizer's vocabulary size."""
    env = gymnasium.make("LongStraw/Calculator-v0", **EASY_CALCULATOR_KWARGS)
    policies = [ScriptedPolicy(env)] * (G // 2) + [WrongAnswerPolicy(env, k) for k in range(1, G // 2 + 1)]
    group = [run_episode(env, policy, seed=seed) for policy in policies]
    vocab_size = unwrap_tool_env(env).tokenizer.vocab_size
    env.close()
    assert [t.reward for t in group] == [1.0] * (G // 2) + [0.0] * (G // 2)
    return group, vocab_size


def answer_logprobs(model: torch.nn.Module, group: list[Trajectory]) -> torch.Tensor:
    """Each member's log-likelihood of its loss tokens (its assistant turns) under ``model``, by a plain forward."""
    out = []
    with torch.no_grad():
        for trajectory in group:
            ids = torch.as_tensor(trajectory.token_ids(), dtype=torch.long)
            mask = torch.as_tensor(trajectory.loss_mask(), dtype=torch.bool)[1:]
            logp = torch.log_softmax(model(ids[None]).logits[0, :-1].double(), dim=-1)
            out.append(logp.gather(-1, ids[1:, None])[:, 0][mask].sum())
    return torch.stack(out)
