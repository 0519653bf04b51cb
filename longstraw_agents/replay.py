"""Offline GRPO from a store: ``longstraw replay DB --where "SQL"``.

Episodes are selected with an SQL condition over the ``episodes`` table and regrouped by ``group_id``. Their
behaviour logprobs (stored per token) give truncated importance weights ``min(π_θ/μ, cap)`` (``LossConfig(
importance="tis")``), so data from older policies is corrected rather than trusted. Staleness is the current
policy version minus the episode's: episodes older than ``max_staleness`` are skipped, or kept and flagged.

``fork_at=k`` starts new groups from logged turns instead: a fresh environment with the episode's seed replays the
recorded assistant turns up to turn k — tools are executed again and every observation is checked token for token
against the log (``ReplayMismatch`` otherwise) — and the current policy samples G continuations from there. The
replayed prefix is context (no loss); the continuations are written to the store and trained on-policy.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from longstraw_agents.envs import ToolEnv, unwrap_tool_env
from longstraw_agents.rollout import RolloutLimits, play_until_done
from longstraw_agents.sampler import TorchSampler
from longstraw_agents.store import Store, StoreError
from longstraw_agents.trainer import GRPOTrainer, LossConfig
from longstraw_agents.training import CHECKPOINT, REFERENCE, Run, TrainConfig, has_checkpoint, reference_policy
from longstraw_agents.trajectory import Segment, Trajectory


class ReplayMismatch(RuntimeError):
    """Re-executing a logged episode did not reproduce its logged observations."""


class ReplayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    where: str | None = Field(None, description="SQL condition over the episodes table")
    steps: int = Field(1, ge=1, description="passes over the selected groups")
    groups_per_step: int = Field(4, ge=1)
    max_staleness: int | None = Field(None, ge=0, description="skip episodes older than this many policy versions")
    keep_stale: bool = Field(False, description="keep stale episodes (flagged in the metrics) instead of skipping")
    tis_cap: float = Field(2.0, gt=0.0, description="cap of the truncated importance weights")
    fork_at: int | None = Field(None, ge=0, description="fork new groups from this logged turn")
    fork_group_size: int = Field(4, ge=2, description="continuations per forked group")


def replay_prefix(env: ToolEnv, logged: Trajectory, turns: int) -> np.ndarray:
    """Bring ``env`` to the start of turn ``turns`` of ``logged`` by re-executing its recorded assistant turns.

    Returns every token id of the episode so far (prompt, replayed actions and observations)."""
    if logged.seed is None:
        raise ReplayMismatch("the logged episode has no seed; it cannot be re-executed")
    observation, _ = env.reset(seed=logged.seed, options={"group_id": logged.group_id})
    history = [observation]
    segments = iter(logged.segments)
    expected = _take_context(segments, len(observation))
    _check(observation, expected, logged, "prompt")
    for turn in range(turns):
        action = next((s for s in segments if s.role == "assistant"), None)
        if action is None:
            raise ReplayMismatch(f"episode has fewer than {turns} assistant turns")
        observation, _, terminated, truncated, _ = env.step(action.token_ids)
        if terminated or truncated:
            raise ReplayMismatch(f"the episode ended at turn {turn}, before the fork point {turns}")
        _check(observation, _take_context(segments, len(observation)), logged, f"observation after turn {turn}")
        history += [action.token_ids, observation]
    return np.concatenate(history)


def _take_context(segments, length: int) -> np.ndarray:
    taken, total = [], 0
    while total < length:
        seg = next(segments, None)
        if seg is None:
            break
        taken.append(seg.token_ids)
        total += len(seg)
    return np.concatenate(taken) if taken else np.zeros(0, np.int32)


def _check(actual: np.ndarray, expected: np.ndarray, logged: Trajectory, what: str) -> None:
    if not np.array_equal(np.asarray(actual, np.int64), np.asarray(expected, np.int64)):
        raise ReplayMismatch(f"{logged.env_id} seed {logged.seed}: the re-executed {what} differs from the log")


def as_context(trajectory: Trajectory, before_turn: int) -> Trajectory:
    """The same trajectory with no loss on assistant turns before ``before_turn`` (a replayed prefix)."""

    def strip(s: Segment) -> Segment:
        replayed = s.role == "assistant" and s.turn < before_turn
        return dataclasses.replace(s, loss_mask=np.zeros(len(s), bool)) if replayed else s

    segments = [strip(s) for s in trajectory.segments]
    return dataclasses.replace(trajectory, segments=segments)


class Replayer:
    """Loads the policy of a run and trains it on logged (or forked) groups."""

    def __init__(self, db: str | Path, run_dir: str | Path | None, out_dir: str | Path, config: ReplayConfig):
        self.db_path = Path(db)
        if not self.db_path.exists():
            raise StoreError(f"no store at {self.db_path}")
        run_dir = Path(run_dir) if run_dir is not None else self.db_path.parent
        config_file = run_dir / "config.json"
        if not config_file.exists():
            raise FileNotFoundError(f"{run_dir} has no config.json; pass --run RUN_DIR of the run that made {db}")
        base = TrainConfig.model_validate_json(config_file.read_text())
        loss = base.trainer.loss.model_copy(update={"importance": "tis", "tis_cap": config.tis_cap})
        train_config = base.model_copy(
            update={
                "output_dir": str(out_dir),
                "trainer": base.trainer.model_copy(update={"loss": LossConfig.model_validate(loss.model_dump())}),
                "warm_start": None,
            }
        )
        self.config = config
        self.run = Run(train_config, resume=False)
        self.run.trainer = GRPOTrainer(
            self.run.model, train_config.trainer, ref_model=self._reference(run_dir, train_config)
        )
        if has_checkpoint(run_dir):
            self.run.trainer.load_checkpoint(run_dir / CHECKPOINT)
        self.source = Store.open(self.db_path, create=False)

    def _reference(self, run_dir: Path, config: TrainConfig):
        """The source run's KL reference (beta > 0), copied into the replay run."""
        if config.trainer.loss.beta == 0.0:
            return None
        source = run_dir / REFERENCE
        if not source.exists():
            raise FileNotFoundError(f"the run uses a KL penalty (beta > 0) but {source} is missing")
        shutil.copyfile(source, self.run.dir / REFERENCE)
        return reference_policy(self.run, resume=True)

    @property
    def trainer(self) -> GRPOTrainer:
        return self.run.trainer

    def logged_groups(self) -> tuple[list[list[Trajectory]], dict[str, int]]:
        """Selected episodes regrouped by group_id, with staleness applied; plus counts for the metrics."""
        version = self.trainer.policy_version
        counts = {"episodes": 0, "stale": 0, "skipped_stale": 0, "skipped_small_groups": 0}
        groups = []
        for members in self.source.groups(self.config.where).values():
            kept = []
            for t in members:
                counts["episodes"] += 1
                stale = self.config.max_staleness is not None and version - t.policy_version > self.config.max_staleness
                if stale:
                    counts["stale"] += 1
                    if not self.config.keep_stale:
                        counts["skipped_stale"] += 1
                        continue
                kept.append(t)
            if len(kept) < 2:
                counts["skipped_small_groups"] += 1 if kept else 0
                continue
            groups.append(kept)
        return groups, counts

    def forked_groups(self) -> list[list[Trajectory]]:
        """New groups sampled by the current policy from turn ``fork_at`` of each selected episode."""
        turn, size = self.config.fork_at, self.config.fork_group_size
        sampler = TorchSampler(
            self.trainer.engine,
            self.run.stop_ids,
            self.run.config.sampling,
            policy_version=self.trainer.policy_version,
        )
        limits = RolloutLimits(self.run.config.sampling.max_new_tokens, self.run.max_context)
        groups = []
        for record in self.source.records(self.config.where):
            logged = record.trajectory
            envs = [unwrap_tool_env(self.run.env_factory()) for _ in range(size)]
            prefixes = [replay_prefix(env, logged, turn) for env in envs]
            group_id = f"fork-episode{record.id}-t{turn}"
            for env in envs:
                env.trajectory.group_id = group_id
                env.trajectory.policy_version = self.trainer.policy_version
            handles = sampler.fork(prefixes[0].tolist(), size)
            played = play_until_done(envs, handles, sampler, limits)
            forked = [as_context(t, turn) for t in played]
            self.run.store.add_episodes(forked, run_id=self.run.run_id)
            groups.append(forked)
        return groups

    def train(self, emit: Callable[[dict[str, Any]], None]) -> None:
        if self.config.fork_at is not None:
            groups = self.forked_groups()
            counts = {"forked_groups": len(groups)}
        else:
            groups, counts = self.logged_groups()
        emit({"phase": "replay_select", **counts, "groups": len(groups), "policy_version": self.trainer.policy_version})
        if not groups:
            raise ValueError("no trainable groups selected (need >= 2 episodes per group); check --where")
        per_step = self.config.groups_per_step
        for _ in range(self.config.steps):
            for lo in range(0, len(groups), per_step):
                start = time.perf_counter()
                batch = [self.trainer.group_from_trajectories(g) for g in groups[lo : lo + per_step]]
                metrics = self.trainer.train_step(batch)
                emit({"phase": "grpo", **metrics, "replay_seconds": time.perf_counter() - start})
        self.trainer.save_checkpoint(self.run.dir / CHECKPOINT)

    def close(self) -> None:
        self.source.close()
        self.run.store.close()


def replay(
    db: str | Path,
    config: ReplayConfig,
    run_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    on_metrics: Callable[[dict[str, Any]], None] | None = None,
) -> Path:
    out = Path(out_dir) if out_dir is not None else Path(db).parent / "replay"
    replayer = Replayer(db, run_dir, out, config)
    metrics_path = replayer.run.dir / "metrics.jsonl"

    def emit(record: dict[str, Any]) -> None:
        with metrics_path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if on_metrics is not None:
            on_metrics(record)

    try:
        replayer.train(emit)
    finally:
        replayer.close()
    return replayer.run.dir


__all__ = ["ReplayConfig", "ReplayMismatch", "Replayer", "as_context", "replay", "replay_prefix"]
