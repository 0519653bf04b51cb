"""Gymnasium environments for agents, registered under the ``LongStraw`` namespace when this package is imported.

>>> import gymnasium
>>> import longstraw_agents.envs
>>> env = gymnasium.make("LongStraw/Calculator-v0", num_operations=1, max_operand=9, word_problems=False)
>>> prompt_ids, info = env.reset(seed=0)
>>> info["tools"]
['calculator']

Every env is a `ToolEnv`: actions and observations are token ids (see `longstraw_agents.envs.base`), and the
episode accumulates as a token-exact `Trajectory` in ``env.unwrapped.trajectory``. `ScriptedPolicy` plays an
env's reference solution; `run_episode` runs any policy for one episode.
"""

from __future__ import annotations

import gymnasium

from longstraw_agents.registration import ENV_IDS, NAMESPACE, register_envs

from .base import (
    Action,
    Score,
    ToolEnv,
    ToolEnvConfig,
    schema_instructions,
    system_prompt_with_tools,
    tool_instructions,
)
from .calculator import EASY_CALCULATOR_KWARGS, CalculatorConfig, CalculatorEnv
from .context import (
    Append,
    ContextChange,
    ContextConfig,
    ContextPlan,
    ContextPolicy,
    ContextView,
    Eviction,
    EvictToolOutputs,
    Replace,
    SummarizeTurns,
    SummaryTurn,
    Unbounded,
)
from .key_value import FormatOnlyPolicy, KeyValueRecallConfig, KeyValueRecallEnv
from .needle_search import NeedleSearchConfig, NeedleSearchEnv
from .page_recall import PageRecallConfig, PageRecallEnv
from .policy import Policy, ScriptedPolicy, run_episode, unwrap_tool_env
from .python_task import PythonTaskConfig, PythonTaskEnv


def registered_env_ids() -> list[str]:
    """Every environment id in the ``LongStraw`` namespace of Gymnasium's registry, sorted."""
    return sorted(env_id for env_id, spec in gymnasium.registry.items() if spec.namespace == NAMESPACE)


register_envs()

__all__ = [
    "EASY_CALCULATOR_KWARGS",
    "ENV_IDS",
    "NAMESPACE",
    "Action",
    "Append",
    "CalculatorConfig",
    "CalculatorEnv",
    "ContextChange",
    "ContextConfig",
    "ContextPlan",
    "ContextPolicy",
    "ContextView",
    "EvictToolOutputs",
    "Eviction",
    "FormatOnlyPolicy",
    "KeyValueRecallConfig",
    "KeyValueRecallEnv",
    "NeedleSearchConfig",
    "NeedleSearchEnv",
    "PageRecallConfig",
    "PageRecallEnv",
    "Policy",
    "PythonTaskConfig",
    "PythonTaskEnv",
    "Replace",
    "Score",
    "ScriptedPolicy",
    "SummarizeTurns",
    "SummaryTurn",
    "ToolEnv",
    "ToolEnvConfig",
    "Unbounded",
    "registered_env_ids",
    "run_episode",
    "schema_instructions",
    "system_prompt_with_tools",
    "tool_instructions",
    "unwrap_tool_env",
]
