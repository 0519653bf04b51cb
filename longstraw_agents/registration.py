"""Gymnasium ids of the LongStraw environments, registered lazily (entry-point strings: nothing is imported).

``import longstraw_agents`` registers them, so ``gymnasium.make("LongStraw/Calculator-v0")`` works after any import
of the package, without loading the environments (or their tokenizer) until one is made.
"""

from __future__ import annotations

NAMESPACE = "LongStraw"
ENV_IDS: dict[str, str] = {
    f"{NAMESPACE}/Calculator-v0": "longstraw_agents.envs.calculator:CalculatorEnv",
    f"{NAMESPACE}/KeyValueRecall-v0": "longstraw_agents.envs.key_value:KeyValueRecallEnv",
    f"{NAMESPACE}/NeedleSearch-v0": "longstraw_agents.envs.needle_search:NeedleSearchEnv",
    f"{NAMESPACE}/PageRecall-v0": "longstraw_agents.envs.page_recall:PageRecallEnv",
    f"{NAMESPACE}/PythonTask-v0": "longstraw_agents.envs.python_task:PythonTaskEnv",
}


def register_envs() -> None:
    import gymnasium

    for env_id, entry_point in ENV_IDS.items():
        if env_id not in gymnasium.registry:  # importing twice (or reloading) must not warn about overriding
            gymnasium.register(id=env_id, entry_point=entry_point)
