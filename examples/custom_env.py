"""A custom LongStraw environment: reverse a word with a tool. Run: python examples/custom_env.py"""

import gymnasium
import numpy as np

from longstraw_agents.envs import ScriptedPolicy, ToolEnv, run_episode
from longstraw_agents.tools import Tool, format_tool_call, tool


@tool
def reverse(text: str) -> str:
    """Reverse a string.

    Args:
        text: The text to reverse.
    """
    return text[::-1]


class ReverseEnv(ToolEnv[str]):
    """The task is a random word; the reward is 1 for its reversal."""

    instructions = "Reverse the user's word. Use the reverse tool."

    def make_task(self, rng: np.random.Generator) -> str:
        return "".join(rng.choice(list("abcdefghij"), size=6))

    def tools(self, task: str) -> list[Tool]:
        return [reverse]

    def user_prompt(self, task: str) -> str:
        return f"Reverse the word {task}."

    def score(self, task: str, answer: str) -> float:
        return float(answer == task[::-1])

    def scripted_turns(self, task: str) -> list[str]:  # the oracle: call the tool, then answer
        return [format_tool_call("reverse", {"text": task}), f"<answer>{task[::-1]}</answer>"]


gymnasium.register("MyTasks/Reverse-v0", entry_point=ReverseEnv)

if __name__ == "__main__":
    env = gymnasium.make("MyTasks/Reverse-v0", max_turns=3)
    trajectory = run_episode(env, ScriptedPolicy(env), seed=0)
    for segment in trajectory:
        print(f"[{segment.role}] {segment.text!r}")
    print(f"reward {trajectory.reward} ({trajectory.finish_reason}, {trajectory.num_tokens} tokens)")
