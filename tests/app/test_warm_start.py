"""The warm start's stages (``app/warm_start.py``): drills of the environment on fresh documents, then its scripted
episodes (with ``env_kwargs`` over the run's) and the rehearsed drills, a record per stage."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import gymnasium
import pytest
import torch
from safetensors.torch import load_file
from tiny_runs import tiny_config

from longstraw_agents.app import run as run_module
from longstraw_agents.app import warm_start as warm_start_module
from longstraw_agents.app.config import WarmStartSpec
from longstraw_agents.app.plotting import read_metrics
from longstraw_agents.app.records import WarmStartRecord
from longstraw_agents.app.run import REFERENCE, build_policy
from longstraw_agents.app.training import train
from longstraw_agents.app.warm_start import Drills
from longstraw_agents.envs import unwrap_tool_env
from longstraw_agents.trajectory import Trajectory

PAGE_RECALL = "LongStraw/PageRecall-v0"
RUN_KWARGS = {"pages": 3, "page_tokens": 60, "codes": 4}


def spec(**updates) -> WarmStartSpec:
    sft = {"steps": 2, "batch_size": 2, "lr": 1e-3}
    return WarmStartSpec.model_validate(
        {
            "episodes": 3,
            "sft": sft,
            "env_kwargs": {"pages": 2},
            "drill": [{"tokens": [20, 40], "sft": sft}, {"tokens": [80, 120], "sft": {**sft, "steps": 3}}],
            "rehearsal": 0.5,
            **updates,
        }
    )


def test_the_stages_run_in_turn_each_on_its_own_documents(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Drill 1 and 2 on ``steps * batch_size`` fresh documents of their lengths, then the episodes of the warm
    start's env (2 pages, not the run's 3) with as many drills of the last stage's lengths (rehearsal 0.5)."""
    learned: list[tuple[str, list[Trajectory]]] = []
    real = warm_start_module.supervised_warm_start

    def spy(model, documents, config, progress, label):  # noqa: ANN001, ANN202
        learned.append((label, list(documents)))
        return real(model, documents, config, progress=progress, label=label)

    monkeypatch.setattr(warm_start_module, "supervised_warm_start", spy)
    trainer = {"group_size": 4, "lr": 1e-3, "beta": 0.04}  # (beta > 0: the run keeps the policy GRPO starts from)
    config = tiny_config(
        tmp_path / "run", env={"id": PAGE_RECALL, "kwargs": RUN_KWARGS}, steps=0, trainer=trainer, warm_start=spec()
    )
    before = {}

    def policy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        model = build_policy(*args, **kwargs)
        before.update({name: p.detach().clone() for name, p in model.named_parameters()})
        return model

    monkeypatch.setattr(run_module, "build_policy", policy)
    train(config)
    records = [r for r in read_metrics(tmp_path / "run") if r["phase"] == WarmStartRecord.PHASE]
    trained = load_file(tmp_path / "run" / REFERENCE)  # the policy as GRPO starts (beta > 0 keeps it)
    assert [label for label, _ in learned] == ["warm start, drill 1", "warm start, drill 2", "warm start, episodes"]
    assert [r["stage"] for r in records] == ["drill 1", "drill 2", "episodes"]
    assert [(r["episodes"], r["drills"], r["steps"]) for r in records] == [(0, 4, 2), (0, 6, 3), (3, 3, 2)]
    assert all(r["loss_first"] is not None and r["seconds"] > 0 for r in records)
    drill_1, drill_2, episodes = (documents for _, documents in learned)
    assert all(20 * 0.7 <= d.num_tokens <= 40 * 1.3 + 20 for d in drill_1)
    assert all(80 * 0.7 <= d.num_tokens <= 120 * 1.3 + 20 for d in [*drill_2, *episodes[3:]])
    assert all("Page 2 of 2." in "".join(s.text for s in t.segments) for t in episodes[:3])
    assert all(t.reward == 1.0 for t in episodes[:3])  # scripted solutions
    assert any(not torch.equal(before[name], trained[name]) for name in before)


def test_each_drill_stage_draws_its_own_documents_the_same_in_every_run() -> None:
    drills = Drills(unwrap_tool_env(gymnasium.make(PAGE_RECALL, **RUN_KWARGS)))
    ids = [[s.token_ids.tolist() for s in d.segments] for d in drills.documents([20, 40], 3, stage=0)]
    assert ids == [[s.token_ids.tolist() for s in d.segments] for d in drills.documents([20, 40], 3, stage=0)]
    assert ids != [[s.token_ids.tolist() for s in d.segments] for d in drills.documents([20, 40], 3, stage=1)]


@pytest.mark.parametrize(("rehearsal", "episodes", "drills"), [(0.0, 8, 0), (0.5, 8, 8), (0.25, 9, 3), (0.9, 2, 18)])
def test_rehearsal_is_the_share_of_drills_among_the_episodes_stage(
    rehearsal: float, episodes: int, drills: int
) -> None:
    stages: Sequence[dict] = [{"tokens": [1, 2]}] if rehearsal else []
    assert WarmStartSpec(episodes=episodes, rehearsal=rehearsal, drill=stages).rehearsed_drills == drills
