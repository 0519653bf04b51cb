"""The supervised warm start before GRPO (`WarmStartSpec`): the drill stages in turn, each on fresh documents of the
environment's drill (``ToolEnv.drill_document``), then the scripted episodes with a share of drills rehearsed among
them. A record per stage goes to ``metrics.jsonl``.

A tiny random-init policy does not learn from episodes alone what their reward turns on when that is one token in
a long layout (PageRecall's code, carried through a dozen summaries): the drill teaches it alone, the episodes then
teach the layout around it (README, "Compaction that learns"; `bench.ablation_learning` found the same for
key-value recall)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import gymnasium
import numpy as np
import torch

from longstraw_agents.app.config import WarmStartSpec
from longstraw_agents.app.records import WarmStartRecord, warm_start_label
from longstraw_agents.app.seeds import drill_seed, warm_start_seed
from longstraw_agents.envs import ScriptedPolicy, ToolEnv, run_episode, unwrap_tool_env
from longstraw_agents.trainer.sft import SFTConfig, supervised_warm_start
from longstraw_agents.trajectory import Trajectory

EnvFactory = Callable[[], gymnasium.Env]


@dataclass(frozen=True)
class Drills:
    """Drill documents of ``env``, each stage's drawn from its own generator (`seeds.drill_seed`)."""

    env: ToolEnv

    def documents(self, tokens: Sequence[int], count: int, stage: int) -> list[Trajectory]:
        """``count`` documents, each about a length drawn uniformly from ``tokens``, [shortest, longest]."""
        rng = np.random.default_rng(drill_seed(stage))
        return [self.env.drill_document(rng, int(rng.integers(tokens[0], tokens[1] + 1))) for _ in range(count)]


def warm_start(
    model: torch.nn.Module,
    spec: WarmStartSpec,
    episodes: EnvFactory,
    emit: Callable[[WarmStartRecord], None],
    progress: bool,
) -> None:
    """``spec``'s stages on ``model``: drills from ``episodes``' environment, then its scripted episodes."""
    env = episodes()
    drills = Drills(unwrap_tool_env(env))
    for number, stage in enumerate(spec.drill):
        documents = drills.documents(stage.tokens, stage.sft.steps * stage.sft.batch_size, stage=number)
        _learn(model, f"drill {number + 1}", documents, stage.sft, emit, progress, drills=len(documents))
    policy = ScriptedPolicy(env)
    traces = [run_episode(env, policy, seed=warm_start_seed(k)) for k in range(spec.episodes)]
    rehearsed = drills.documents(spec.drill[-1].tokens, spec.rehearsed_drills, len(spec.drill)) if spec.drill else []
    _learn(model, "episodes", traces + rehearsed, spec.sft, emit, progress, episodes=len(traces), drills=len(rehearsed))


def _learn(
    model: torch.nn.Module,
    stage: str,
    documents: list[Trajectory],
    sft: SFTConfig,
    emit: Callable[[WarmStartRecord], None],
    progress: bool,
    episodes: int = 0,
    drills: int = 0,
) -> None:
    start = time.perf_counter()
    losses = supervised_warm_start(model, documents, sft, progress=progress, label=warm_start_label(stage, drills))
    emit(
        WarmStartRecord(
            stage=stage,
            episodes=episodes,
            drills=drills,
            steps=len(losses),
            loss_first=losses[0] if losses else None,
            loss_last=losses[-1] if losses else None,
            seconds=time.perf_counter() - start,
        )
    )
