"""The lines of metrics.jsonl (app/records.py) as an experiment tracker gets them: numbers named by phase, at the
optimizer step the record belongs to."""

from __future__ import annotations

from longstraw_agents.app.records import EvalRecord, ReplaySelectRecord, StepRecord, WarmStartRecord
from longstraw_agents.trainer import StepMetrics
from longstraw_agents.trainer.metrics import IterationMetrics

ITERATION = IterationMetrics(
    loss=0.25, grad_norm=0.5, lr=1e-3, kl=None, forward_tokens=90, seconds=1.5, peak_bytes=None
)
METRICS = StepMetrics(
    step=4,
    policy_version=4,
    mode="exact",
    loss=0.25,
    reward_mean=0.375,
    reward_std=0.5,
    grad_norm=0.5,
    lr=1e-3,
    loss_tokens=40,
    unique_tokens=60,
    sequence_tokens=75,
    forward_tokens=90,
    seconds=1.5,
    peak_bytes=None,
    kl=None,
    iterations=(ITERATION,),
)


def test_a_step_record_gives_its_numbers_under_grpo_at_its_step() -> None:
    record = StepRecord(
        metrics=METRICS, episode_tokens_mean=120.5, rollout_seconds=2.0, finish_reasons={"stop": 6, "max_turns": 2}
    )
    assert record.at_step == 4
    assert record.tracker_values() == {
        "grpo/policy_version": 4,
        "grpo/loss": 0.25,
        "grpo/reward_mean": 0.375,
        "grpo/reward_std": 0.5,
        "grpo/grad_norm": 0.5,
        "grpo/lr": 1e-3,
        "grpo/loss_tokens": 40,
        "grpo/unique_tokens": 60,
        "grpo/sequence_tokens": 75,
        "grpo/forward_tokens": 90,
        "grpo/seconds": 1.5,
        "grpo/episode_tokens_mean": 120.5,
        "grpo/rollout_seconds": 2.0,
        "grpo/finish_reasons/stop": 6,
        "grpo/finish_reasons/max_turns": 2,
    }  # not the mode (text), the iterations (a list), nor the nulls (peak_bytes, kl, replay_seconds...)


def test_records_without_a_step_of_their_own() -> None:
    warm_start = WarmStartRecord(episodes=8, steps=0, loss_first=None, loss_last=None, seconds=0.25)
    assert warm_start.at_step == 0  # before the first GRPO step
    assert warm_start.tracker_values() == {
        "warm_start/episodes": 8,
        "warm_start/drills": 0,
        "warm_start/steps": 0,
        "warm_start/seconds": 0.25,
    }
    assert warm_start.summary() == "warm start: 8 scripted episodes, 0 steps, no steps"
    drill = WarmStartRecord(stage="drill 1", episodes=0, drills=16, steps=2, loss_first=2.0, loss_last=1.0, seconds=1.0)
    assert drill.summary() == "warm start, drill 1: 16 drill documents, 2 steps, loss 2.000 -> 1.000"
    assert drill.tracker_values()["warm_start/drill_1/loss_last"] == 1.0  # not the episodes' stage's figure
    rehearsed = drill.model_copy(update={"stage": "episodes", "episodes": 8})
    assert rehearsed.summary().startswith("warm start, episodes: 8 scripted episodes + 16 drill documents")
    evaluation = EvalRecord(step=3, reward_mean=0.5, episodes=4, policy_version=3)
    assert evaluation.at_step == 3
    assert evaluation.tracker_values() == {"eval/reward_mean": 0.5, "eval/episodes": 4, "eval/policy_version": 3}
    selected = ReplaySelectRecord(
        policy_version=2, policy_source="checkpoint", groups=4, groups_skipped_uniform=1, groups_trained=3
    )
    assert selected.at_step is None  # the run's current step
    assert selected.tracker_values() == {
        "replay_select/policy_version": 2,
        "replay_select/groups": 4,
        "replay_select/groups_skipped_uniform": 1,
        "replay_select/groups_trained": 3,
    }
