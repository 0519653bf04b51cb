"""Offline GRPO from a store: ``longstraw replay DB --where "SQL"``.

Groups are rebuilt by ``(run_id, group_id)``; ``where`` is an SQL condition over the ``episodes`` table that keeps
every group with at least one matching member, whole (``reward > 0``: the groups that solved the task at least
once, unsolved members included, since a group learns from the difference). Episodes without a group id (scripted
or eval episodes) are in no group. Groups of fewer than 2 members or with equal rewards have zero advantages, so
they are counted in the metrics and skipped rather than trained on. Behaviour logprobs (stored per token) give
truncated importance weights ``min(π_θ/μ, cap)`` (``LossConfig(importance="tis")``), so data from older policies is
corrected rather than trusted. Staleness is the current policy version minus the episode's: episodes older than
``max_staleness`` are skipped, or kept and flagged.

``fork_at=k`` starts new groups from logged turns instead (``where`` then selects the episodes to fork from): a
fresh environment built from the episode's env id and its run's env kwargs, reset with the episode's seed, replays
the recorded assistant turns up to turn k and every observation is checked token for token against the log. By
default (``recorded_tools``) the prefix's tool calls are answered with their logged results, so nondeterministic or
side-effecting tools (web, timings) replay exactly; a tool that keeps state between calls then starts the
continuation without the prefix's calls, so pass ``recorded_tools=False`` to execute them again (and check them
against the log). Episodes that cannot be forked (too short, no seed, unknown env, a mismatch) are skipped and
counted. The current policy samples G continuations from each prefix; the replayed prefix is context (no loss);
the continuations are written to the store and trained on-policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from longstraw_agents.app.config import TrainConfig
from longstraw_agents.app.records import ReplaySelectRecord, StepRecord
from longstraw_agents.app.run import CHECKPOINT, REFERENCE, OnMetrics, Run, has_checkpoint
from longstraw_agents.envs import ToolEnv, unwrap_tool_env
from longstraw_agents.rollout import EnvFactory, RolloutLimits, make_env_factory, play_until_done
from longstraw_agents.sampler import Sampler
from longstraw_agents.store import EpisodeRecord, Store, StoreError
from longstraw_agents.tools import ToolCall, ToolCallError, ToolResult
from longstraw_agents.trainer import GRPOTrainer, LossConfig
from longstraw_agents.trajectory import Segment, Trajectory

log = logging.getLogger(__name__)

# Why a logged episode could not be forked; each is counted as ``fork_skipped_<reason>`` in the metrics.
FORK_SKIP_REASONS = ("too_short", "no_seed", "env", "mismatch", "edited")


class ReplayMismatch(RuntimeError):
    """Re-executing a logged episode did not reproduce its logged observations, or it cannot be re-executed.

    ``reason`` is one of `FORK_SKIP_REASONS`."""

    def __init__(self, message: str, reason: str = "mismatch") -> None:
        super().__init__(message)
        self.reason = reason


class ReplayConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    where: str | None = Field(
        None,
        description="SQL condition over the episodes table: keeps whole groups with at least one matching member "
        "(with fork_at: the episodes to fork from)",
    )
    steps: int = Field(1, ge=1, description="passes over the selected groups")
    groups_per_step: int = Field(4, ge=1)
    max_staleness: int | None = Field(None, ge=0, description="skip episodes older than this many policy versions")
    keep_stale: bool = Field(False, description="keep stale episodes (flagged in the metrics) instead of skipping")
    tis_cap: float = Field(2.0, gt=0.0, description="cap of the truncated importance weights")
    fork_at: int | None = Field(None, ge=0, description="fork new groups from this logged turn")
    fork_group_size: int = Field(4, ge=2, description="continuations per forked group")
    recorded_tools: bool = Field(
        True, description="fork_at: answer the replayed turns' tool calls with their logged results (no re-run)"
    )


class _LoggedTools:
    """Answers a replayed prefix's tool calls (as the env's ``tool_executor``): each call gets the result logged for
    it, turn by turn."""

    def __init__(self, logged: Trajectory, env: ToolEnv) -> None:
        self._by_turn: dict[int, list[dict[str, Any]]] = {}
        for s in logged.segments:
            if s.role == "tool" and s.tool_calls:
                self._by_turn.setdefault(s.turn, []).extend(s.tool_calls)
        self._env, self._turn = env, 0
        self._pending: list[dict[str, Any]] = []

    def start_turn(self, turn: int) -> None:
        self._turn, self._pending = turn, list(self._by_turn.get(turn, []))

    def end_turn(self) -> None:
        if self._pending:
            raise ReplayMismatch(f"turn {self._turn} made fewer tool calls than the log ({len(self._pending)} left)")

    def __call__(self, call: ToolCall | ToolCallError) -> ToolResult:
        if not self._pending:
            raise ReplayMismatch(f"turn {self._turn} made more tool calls than the log")
        result = ToolResult.model_validate(self._pending.pop(0))
        if isinstance(call, ToolCall) and call.name in self._env.registry and call.name != result.name:
            raise ReplayMismatch(f"turn {self._turn} called {call.name!r} where the log has {result.name!r}")
        return result


@contextlib.contextmanager
def _answering_from_log(env: ToolEnv, tools: _LoggedTools | None) -> Iterator[None]:
    """Answer the episode's tool calls with ``tools`` (None: run them); the env runs its tools again afterwards."""
    if tools is None:
        yield
        return
    env.tool_executor = tools
    try:
        yield
    finally:
        env.tool_executor = None


def replay_prefix(env: ToolEnv, logged: Trajectory, turns: int, recorded_tools: bool = True) -> np.ndarray:
    """Bring ``env`` to the start of turn ``turns`` of ``logged`` by replaying its recorded assistant turns.

    With ``recorded_tools`` the tool calls get their logged results; otherwise the tools run again. Either way every
    observation must equal the log token for token (``ReplayMismatch`` otherwise). Returns every token id of the
    episode so far (prompt, replayed actions and observations)."""
    if logged.seed is None:
        raise ReplayMismatch("the logged episode has no seed; it cannot be re-executed", "no_seed")
    actions = [k for k, s in enumerate(logged.segments) if s.role == "assistant"]
    if len(actions) < turns:
        raise ReplayMismatch(f"episode has fewer than {turns} assistant turns", "too_short")
    fork_point = actions[turns] if turns < len(actions) else len(logged.segments)
    if any(edit.before <= fork_point for edit in logged.edits):
        # the environment re-executes appends only: it cannot reproduce a context it evicted or summarised
        raise ReplayMismatch(f"the episode edited its context before turn {turns}", "edited")
    try:
        observation, _ = env.reset(seed=logged.seed, options={"group_id": logged.group_id})
    except ValueError as err:  # e.g. the prompt no longer fits the (model-capped) token budget
        raise ReplayMismatch(f"{logged.env_id} seed {logged.seed}: reset failed: {err}", "env") from err
    history = [observation]
    segments = iter(logged.segments)
    expected = _take_context(segments, len(observation))
    _check(observation, expected, logged, "prompt")
    tools = _LoggedTools(logged, env) if recorded_tools else None
    with _answering_from_log(env, tools):
        for turn in range(turns):
            action = next((s for s in segments if s.role == "assistant"), None)
            if action is None:  # the log's observations were shorter than the re-executed ones
                raise ReplayMismatch(f"the log has no assistant turn {turn} after the re-executed observations")
            if tools is not None:
                tools.start_turn(turn)
            observation, _, terminated, truncated, _ = env.step(action.token_ids)
            if terminated or truncated:
                raise ReplayMismatch(f"the episode ended at turn {turn}, before the fork point {turns}", "too_short")
            if tools is not None:
                tools.end_turn()
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


def logged_env_kwargs(trajectory: Trajectory, run_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``gymnasium.make`` kwargs a logged episode was played with: what its run recorded for its env id (a
    training run's ``env``, or the demo's ``envs`` table), with the budgets the env wrote into the episode's info
    (``max_tokens`` may have been capped to the model's context)."""
    kwargs: dict[str, Any] = {}
    config = run_config or {}
    env, envs = config.get("env"), config.get("envs")
    if isinstance(env, Mapping) and env.get("id") == trajectory.env_id:
        kwargs = dict(env.get("kwargs") or {})
    elif isinstance(envs, Mapping) and isinstance(envs.get(trajectory.env_id), Mapping):
        kwargs = dict(envs[trajectory.env_id])
    budgets: dict[str, Any] = {k: trajectory.info[k] for k in ("max_turns", "max_tokens") if k in trajectory.info}
    return {**kwargs, **budgets}


def _rewards_differ(group: Sequence[Trajectory]) -> bool:
    # equal rewards give every member a zero advantage: no GRPO signal
    return len({t.reward for t in group}) > 1


def trainable(groups: list[list[Trajectory]], counts: dict[str, Any]) -> list[list[Trajectory]]:
    """The groups whose rewards differ; the others are counted as ``groups_skipped_uniform``."""
    kept = [g for g in groups if _rewards_differ(g)]
    counts.update(groups=len(groups), groups_skipped_uniform=len(groups) - len(kept), groups_trained=len(kept))
    return kept


def select_logged_groups(
    source: Store, config: ReplayConfig, policy_version: int
) -> tuple[list[list[Trajectory]], dict[str, int]]:
    """Whole groups with a member matching ``config.where``, staleness applied, uniform ones dropped; plus counts."""
    counts = dict.fromkeys(("episodes", "stale", "skipped_stale", "skipped_unrewarded", "skipped_small_groups"), 0)
    counts["skipped_ungrouped"] = source.ungrouped_count(config.where)
    groups = []
    for group in source.group_records(config.where):
        kept = []
        for t in group.trajectories:
            counts["episodes"] += 1
            if t.reward is None:  # an episode that never finished has no reward to learn from
                counts["skipped_unrewarded"] += 1
                continue
            if config.max_staleness is not None and policy_version - t.policy_version > config.max_staleness:
                counts["stale"] += 1
                if not config.keep_stale:
                    counts["skipped_stale"] += 1
                    continue
            kept.append(t)
        if len(kept) < 2:
            counts["skipped_small_groups"] += 1 if kept else 0
            continue
        groups.append(kept)
    return trainable(groups, counts), counts


def _open_source(db: Path, where: str | None) -> Store:
    """The source store, checked before anything is built: a store, with episodes, and ``where`` valid SQL."""
    source = Store.open(db, create=False)
    try:
        if not source.count():
            raise StoreError(f"{db} holds no episodes; nothing to replay")
        source.count(where)  # bad SQL fails here, before a model is built
    except BaseException:
        source.close()
        raise
    return source


def _replay_config(run_dir: Path, db: Path, out_dir: Path, config: ReplayConfig) -> TrainConfig:
    """The source run's config with TIS on, writing to ``out_dir`` (which must not hold a run yet)."""
    config_file = run_dir / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{run_dir} has no config.json; pass --run RUN_DIR of the run that made {db}")
    if out_dir.resolve() == run_dir.resolve():
        raise FileExistsError(f"--out {out_dir} is the source run directory; choose another --out")
    if has_checkpoint(out_dir):
        raise FileExistsError(f"{out_dir} already holds a run; choose another --out")
    base = TrainConfig.model_validate_json(config_file.read_text())
    loss = base.trainer.loss.model_copy(update={"importance": "tis", "tis_cap": config.tis_cap})
    return base.model_copy(
        update={
            "output_dir": str(out_dir),
            "trainer": base.trainer.model_copy(update={"loss": LossConfig.model_validate(loss.model_dump())}),
            "warm_start": None,
        }
    )


class Replayer:
    """Loads the policy of a run and trains it on logged (or forked) groups."""

    def __init__(
        self,
        db: str | Path,
        run_dir: str | Path | None,
        out_dir: str | Path,
        config: ReplayConfig,
        on_metrics: OnMetrics | None = None,
    ):
        self.db_path = Path(db)
        self.config = config
        self.source = _open_source(self.db_path, config.where)  # the DB first: its errors name the real problem
        try:
            run_dir = Path(run_dir) if run_dir is not None else self.db_path.parent
            train_config = _replay_config(run_dir, self.db_path, Path(out_dir), config)
            # the source run's KL reference (used when beta > 0), copied into the replay run
            self.run = Run(train_config, resume=False, reference=run_dir / REFERENCE, on_metrics=on_metrics)
        except BaseException:
            self.source.close()
            raise
        try:
            self.policy_source = self._load_policy(run_dir)
        except BaseException:
            self.close()
            raise

    def _load_policy(self, run_dir: Path) -> str:
        """Load the run's checkpoint; without one, say loudly what is trained instead. Returns where it came from."""
        if has_checkpoint(run_dir):
            self.trainer.load_checkpoint(run_dir / CHECKPOINT)
            return "checkpoint"
        path = self.run.config.model.path
        what = f"the weights of {path}" if path else "a RANDOMLY INITIALISED policy"
        log.warning("%s has no checkpoint: replay trains %s, not the run's trained policy", run_dir, what)
        return "model_path" if path else "random_init"

    @property
    def trainer(self) -> GRPOTrainer:
        return self.run.trainer

    def logged_groups(self) -> tuple[list[list[Trajectory]], dict[str, int]]:
        """Selected groups with staleness applied and uniform groups dropped; plus counts for the metrics."""
        return select_logged_groups(self.source, self.config, self.trainer.policy_version)

    def forked_groups(self) -> tuple[list[list[Trajectory]], dict[str, Any]]:
        """New groups sampled by the current policy from turn ``fork_at`` of each selected episode; episodes that
        cannot be forked are skipped and counted by reason. Sampled as ``longstraw train`` samples (``Run.sampling``:
        every rank enters; with cp > 1 the first cp rank forks, its peers computing with it and receiving the
        groups)."""
        turn = self.config.fork_at
        if turn is None:
            raise ValueError("forked_groups needs ReplayConfig.fork_at (the logged turn to fork from)")
        forked = None
        with self.run.sampling() as sampler:  # the run's sampling settings and seed
            if sampler is not None:
                forked = self._forked(sampler, turn)
        return self.run.ranks.to_cp_peers(forked)  # type: ignore[return-value]  # (every cp rank's is the first's)

    def _forked(self, sampler: Sampler, turn: int) -> tuple[list[list[Trajectory]], dict[str, Any]]:
        limits = self.run.limits
        run_configs = {run.id: run.config for run in self.source.runs()}
        own_config = self.run.config.model_dump(mode="json")  # for episodes without a recorded run
        skipped: Counter[str] = Counter()
        examples: dict[str, str] = {}
        groups = []
        for record in self.source.records(self.config.where):
            run_config = own_config if record.run_id is None else run_configs.get(record.run_id, own_config)
            try:
                envs, prefix = self._replayed_envs(record, run_config, turn)
            except ReplayMismatch as err:
                skipped[err.reason] += 1
                examples.setdefault(err.reason, f"episode {record.id}: {err}")
                continue
            try:
                groups.append(self._fork(record, envs, prefix, sampler, limits, turn))
            finally:
                for env in envs:
                    env.close()
        if skipped:
            log.warning(
                "fork_at=%d: skipped %d episodes that cannot be forked (%s)",
                turn,
                sum(skipped.values()),
                "; ".join(f"{n} {reason}, e.g. {examples[reason]}" for reason, n in skipped.items()),
            )
        counts: dict[str, Any] = {"forked_groups": len(groups), "fork_skipped": sum(skipped.values())}
        counts.update({f"fork_skipped_{reason}": skipped[reason] for reason in FORK_SKIP_REASONS})
        return trainable(groups, counts), counts

    def _replayed_envs(
        self, record: EpisodeRecord, run_config: Mapping[str, Any], turn: int
    ) -> tuple[list[ToolEnv], np.ndarray]:
        """``fork_group_size`` fresh envs of the logged episode's own env, each replayed to the start of ``turn``."""
        logged = record.trajectory
        kwargs = self.run.env_kwargs(logged_env_kwargs(logged, run_config))  # the policy's tokenizer
        limits = self.run.limits
        factory = make_env_factory(logged.env_id, kwargs, limits)
        envs: list[ToolEnv] = []
        try:
            for _ in range(self.config.fork_group_size):
                envs.append(_make_env(factory, logged.env_id))
                prefix = replay_prefix(envs[-1], logged, turn, self.config.recorded_tools)
        except BaseException:
            for env in envs:
                env.close()
            raise
        return envs, prefix

    def _fork(
        self,
        record: EpisodeRecord,
        envs: list[ToolEnv],
        prefix: np.ndarray,
        sampler: Sampler,
        limits: RolloutLimits,
        turn: int,
    ) -> list[Trajectory]:
        """G continuations of ``prefix`` sampled by the current policy, stored in the replay run as one group."""
        group_id = f"fork-episode{record.id}-t{turn}"
        for env in envs:
            env.trajectory.group_id = group_id
            env.trajectory.policy_version = self.trainer.policy_version
        handles = sampler.fork(prefix.tolist(), len(envs))
        played = play_until_done(envs, handles, sampler, limits)
        forked = [as_context(t, turn) for t in played]
        self.run.store.add_episodes(forked, run_id=self.run.run_id)
        return forked

    def train(self) -> None:
        groups, counts = self.forked_groups() if self.config.fork_at is not None else self.logged_groups()
        version = self.trainer.policy_version
        self.run.emit(ReplaySelectRecord(**counts, policy_version=version, policy_source=self.policy_source))
        if not groups:
            raise ValueError(
                "no trainable groups selected: a group needs >= 2 episodes with different rewards "
                f"({_skip_summary(counts)}); check --where"
            )
        per_step = self.config.groups_per_step
        for _ in range(self.config.steps):
            for lo in range(0, len(groups), per_step):
                start = time.perf_counter()
                chunk = groups[lo : lo + per_step]
                metrics = self.trainer.train_step([self.trainer.group_from_trajectories(g) for g in chunk])
                tokens = [t.num_tokens for g in chunk for t in g]
                self.run.emit(
                    StepRecord(
                        metrics=metrics,
                        episode_tokens_mean=sum(tokens) / len(tokens),
                        replay_seconds=time.perf_counter() - start,
                    )
                )
        self.run.save_checkpoint()

    def close(self) -> None:
        self.source.close()
        self.run.close()


def _make_env(factory: EnvFactory, env_id: str) -> ToolEnv:
    try:
        return unwrap_tool_env(factory())
    except (gymnasium.error.Error, ValueError, TypeError) as err:  # unknown id, kwargs this version rejects
        raise ReplayMismatch(f"cannot build {env_id}: {err}", "env") from err


def _skip_summary(counts: Mapping[str, Any]) -> str:
    skips = {k: v for k, v in counts.items() if ("skipped" in k or k == "groups") and isinstance(v, int) and v}
    return ", ".join(f"{k} {v}" for k, v in skips.items()) or "nothing selected"


def replay(
    db: str | Path,
    config: ReplayConfig,
    run_dir: str | Path | None = None,
    out_dir: str | Path | None = None,
    on_metrics: OnMetrics | None = None,
) -> Path:
    """Train the policy of ``run_dir`` (default: the DB's directory) on logged or forked groups into ``out_dir``
    (default: RUN/replay). A replay that fails leaves nothing behind: what it wrote is removed (a replay directory
    is complete or absent; it cannot be resumed)."""
    out = Path(out_dir) if out_dir is not None else Path(run_dir if run_dir is not None else Path(db).parent) / "replay"
    with _removed_on_failure(out):
        replayer = Replayer(db, run_dir, out, config, on_metrics)
        try:
            replayer.train()
        finally:
            replayer.close()
    return replayer.run.dir


@contextlib.contextmanager
def _removed_on_failure(out: Path) -> Iterator[None]:
    """On an exception, remove what was written under ``out``: the directories created (``out`` and its missing
    parents), or in an ``out`` that existed, the entries added to it. Nothing that was there before is touched."""
    created = next((p for p in reversed([out, *out.parents]) if not p.exists()), None)  # the topmost missing one
    before = set(out.iterdir()) if created is None and out.is_dir() else set()
    try:
        yield
    except BaseException:
        if created is not None:
            shutil.rmtree(created, ignore_errors=True)
        elif out.is_dir():
            for entry in set(out.iterdir()) - before:
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        raise


__all__ = [
    "FORK_SKIP_REASONS",
    "ReplayConfig",
    "ReplayMismatch",
    "Replayer",
    "as_context",
    "logged_env_kwargs",
    "replay",
    "replay_prefix",
    "select_logged_groups",
]
