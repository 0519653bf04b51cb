"""The lines of a run's ``metrics.jsonl``: one typed record per event, written as one JSON object per line.

Each record class names its ``phase`` (the ``"phase"`` key of its line): ``warm_start`` (the supervised warm start),
``eval`` (held-out reward), ``grpo`` (one optimizer step, online or replayed) and ``replay_select`` (what offline
replay selected and skipped). Code that emits or shows metrics works with these classes; ``phase`` strings only
exist in the file. ``summary()`` is the one-line console form the CLI and the demo print; ``tracker_values()`` and
``at_step`` are what an experiment tracker gets (``app.reporting``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from longstraw_agents.trainer import StepMetrics


class MetricsRecord(BaseModel):
    """One line of ``metrics.jsonl``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    PHASE: ClassVar[str]

    def to_json(self) -> str:
        return json.dumps({"phase": self.PHASE, **self.model_dump(mode="json")})

    def summary(self) -> str:
        return " ".join(f"{k}={v}" for k, v in {"phase": self.PHASE, **self.model_dump()}.items())

    @property
    def at_step(self) -> int | None:
        """The optimizer step the record belongs to (None: the run's current one)."""
        return None

    def tracker_values(self) -> dict[str, int | float]:
        """The numbers of the record's line, named ``PHASE/key`` (a mapping's as ``PHASE/key/inner``), for an
        experiment tracker; the line's ``step`` is the tracker's step, and text, lists and nulls are left out."""
        line = json.loads(self.to_json())
        return dict(_numbers({k: v for k, v in line.items() if k not in ("phase", "step")}, f"{self.PHASE}/"))


def _numbers(data: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, int | float]]:
    for key, value in data.items():
        if isinstance(value, Mapping):
            yield from _numbers(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool):
            yield f"{prefix}{key}", value


def warm_start_label(stage: str, drills: int) -> str:
    """A warm-start stage's name in its progress bar and summary: ``warm start`` for one on episodes alone, else
    ``warm start, <stage>``."""
    return "warm start" if stage == "episodes" and not drills else f"warm start, {stage}"


class WarmStartRecord(MetricsRecord):
    PHASE: ClassVar[str] = "warm_start"

    stage: str = "episodes"
    """``drill 1``, ``drill 2``... (`WarmStartSpec.drill`), then ``episodes``."""
    episodes: int
    drills: int = 0
    """Drill documents learned from: a drill stage's, or those rehearsed among the episodes."""
    steps: int
    loss_first: float | None
    loss_last: float | None
    seconds: float

    def summary(self) -> str:
        losses = f"loss {self.loss_first:.3f} -> {self.loss_last:.3f}" if self.steps else "no steps"
        documents = [f"{self.episodes} scripted episodes"] if self.episodes else []
        documents += [f"{self.drills} drill documents"] if self.drills else []
        return f"{self.label}: {' + '.join(documents)}, {self.steps} steps, {losses}"

    @property
    def label(self) -> str:
        return warm_start_label(self.stage, self.drills)

    def tracker_values(self) -> dict[str, int | float]:
        """As every record's, a drill stage's under ``warm_start/<stage>/`` (``warm_start/drill_1/loss_last``),
        so that the stages, all at step 0, do not overwrite each other's figures."""
        values = super().tracker_values()
        if self.stage == "episodes":
            return values
        prefix = f"{self.PHASE}/{self.stage.replace(' ', '_')}/"
        return {prefix + key.removeprefix(f"{self.PHASE}/"): value for key, value in values.items()}

    @property
    def at_step(self) -> int:
        return 0  # before the first GRPO step


class EvalRecord(MetricsRecord):
    PHASE: ClassVar[str] = "eval"

    step: int
    reward_mean: float
    episodes: int
    policy_version: int

    def summary(self) -> str:
        return f"eval at step {self.step}: held-out reward {self.reward_mean:.3f} ({self.episodes} episodes)"

    @property
    def at_step(self) -> int:
        return self.step


class StepRecord(MetricsRecord):
    """An optimizer step: the trainer's ``StepMetrics`` plus what the loop around it measured (its line holds both,
    flat)."""

    PHASE: ClassVar[str] = "grpo"

    metrics: StepMetrics
    episode_tokens_mean: float
    rollout_seconds: float | None = None  # online training: sampling the step's groups (async: waiting for them)
    replay_seconds: float | None = None  # offline replay: the whole step
    solved_fraction: float | None = None
    finish_reasons: dict[str, int] | None = None
    rss_peak_bytes: int | None = None
    cuda_peak_bytes: int | None = None
    # asynchronous GRPO (max_staleness): versions between the oldest weights that sampled a group's tokens and the
    # step's (mean and max over the groups trained on), and the groups dropped beyond the bound
    staleness_mean: float | None = None
    staleness_max: int | None = None
    groups_dropped_stale: int | None = None

    def to_json(self) -> str:
        measured = self.model_dump(mode="json", exclude={"metrics"})
        return json.dumps({"phase": self.PHASE, **self.metrics.to_dict(), **measured})

    def summary(self) -> str:
        m = self.metrics
        seconds = (self.rollout_seconds or 0.0) + m.seconds
        return (
            f"step {m.step:>4}  reward {m.reward_mean:.3f}  loss {m.loss:+.4f}  "
            f"grad_norm {m.grad_norm:.3f}  tokens {self.episode_tokens_mean:.0f}  {seconds:.1f}s"
        )

    @property
    def at_step(self) -> int:
        return self.metrics.step


class ReplaySelectRecord(MetricsRecord):
    """What offline replay selected (logged groups, or groups forked from logged turns) and what it skipped."""

    PHASE: ClassVar[str] = "replay_select"

    policy_version: int
    policy_source: str  # "checkpoint", "model_path" or "random_init"
    groups: int
    groups_skipped_uniform: int
    groups_trained: int
    # logged groups
    episodes: int | None = None
    stale: int | None = None
    skipped_stale: int | None = None
    skipped_unrewarded: int | None = None
    skipped_small_groups: int | None = None
    skipped_ungrouped: int | None = None
    # forked groups
    forked_groups: int | None = None
    fork_skipped: int | None = None
    fork_skipped_too_short: int | None = None
    fork_skipped_no_seed: int | None = None
    fork_skipped_env: int | None = None
    fork_skipped_mismatch: int | None = None
    fork_skipped_edited: int | None = None

    def summary(self) -> str:
        counts = {k: v for k, v in self.model_dump(exclude={"policy_version", "policy_source"}).items() if v}
        return (
            f"replay: policy v{self.policy_version} from {self.policy_source}; "
            + " ".join(f"{k}={v}" for k, v in counts.items())
        ).rstrip()


RECORD_TYPES: dict[str, type[MetricsRecord]] = {
    cls.PHASE: cls for cls in (WarmStartRecord, EvalRecord, StepRecord, ReplaySelectRecord)
}
