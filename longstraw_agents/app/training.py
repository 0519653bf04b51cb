"""The online GRPO loop behind ``longstraw train``: rollout → store → GRPO step → metrics → checkpoint.

``--resume`` continues from the checkpoint; a run resumed after a kill reproduces the uninterrupted run, because
each step's task seeds and sampling generator are derived from (seed, step) (``app.seeds``). Ctrl-C stops after the
current operation, writes the metrics line of an update it let finish and saves a checkpoint of the last completed
step; the store holds whole groups only (one transaction per group), and a resumed step does not store again the
groups it had already written.

With a served policy (``policy.served``, ``app.served``) each step ends by pushing the new weights to the server,
before its metrics line and checkpoint are written.

With ``max_staleness`` set (``app.async_rollouts``) the next steps' rollouts run in a thread while a step trains; the
loop takes each step's groups from it, stores them (one transaction per step, stale groups too), trains on those
within the bound and hands the thread the new weights. Its metrics line says how stale the step's groups were
and how many were dropped; ``rollout_seconds`` is then the time the loop waited for them.

Under ``torchrun`` (``config.parallel``, ``app.distributed``): each dp rank rolls out its share of the step's tasks
(every dp-th task seed, its own sampling seed) and trains on it; the groups are gathered to the writer, which stores
each once (group ids ``step{k}-dp{r}-g{i}``, k counted from 1 as in the metrics) and writes one metrics line for the
whole step.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from tqdm.contrib.logging import logging_redirect_tqdm

from longstraw_agents.app.async_rollouts import AsyncRollouts, StepGroups, async_rollouts, stamp_train_version
from longstraw_agents.app.config import TrainConfig
from longstraw_agents.app.distributed import merged_step_metrics
from longstraw_agents.app.records import EvalRecord, StepRecord
from longstraw_agents.app.run import OnMetrics, Run
from longstraw_agents.app.seeds import eval_sampling_seed, eval_task_seed
from longstraw_agents.progress import progress_bar
from longstraw_agents.rollout import rollout_groups
from longstraw_agents.store import Store
from longstraw_agents.trainer import StepMetrics
from longstraw_agents.trajectory import Trajectory

log = logging.getLogger(__name__)


def train(config: TrainConfig, resume: bool = False, on_metrics: OnMetrics | None = None) -> Path:
    """Run (or resume) a training run; returns the run directory. With ``config.progress``, a bar counts the GRPO
    steps (reward, loss, episode tokens per second) over the rollout's and evaluations' own bars."""
    run = Run(config, resume, on_metrics=on_metrics)
    try:
        with run.ranks.failing_clearly(lambda: f"training step {run.trainer.step_count + 1}"):
            return _train(run, config, resume)
    finally:
        try:
            run.close()  # the store, and the trackers after the last evaluation's record
        finally:
            run.ranks.close()


def _train(run: Run, config: TrainConfig, resume: bool) -> Path:
    completed = run.trainer.step_count
    shown = config.progress and run.ranks.writes
    bar = progress_bar(total=config.steps, initial=completed, desc="GRPO", unit="step", enabled=shown)
    watch = LearningSignalWatch()
    evaluated = run.evaluated_steps() if resume else set()  # a resumed run evaluates no step twice
    try:
        with logging_redirect_tqdm():  # warnings print above the bars instead of through them
            if config.eval_episodes and completed == 0 and 0 not in evaluated:
                run.emit(evaluate(run, config.eval_episodes))
            steps = range(run.trainer.step_count, config.steps)
            with async_rollouts(run, steps, lambda step, dp_rank: group_prefix(run, step, dp_rank)) as rollouts:
                for step in steps:
                    if rollouts is None:
                        record = rollout_and_train(run, step, watch)
                        run.push_weights()  # a served policy: the server samples the new weights from the next step on
                    else:
                        record = take_and_train(run, step, rollouts, watch)
                        rollouts.publish()  # the rollout thread samples them from its next turn on
                    run.emit(record)
                    bar.set_postfix_str(step_postfix(record), refresh=False)
                    bar.update(1)
                    completed = step + 1
                    if completed % config.checkpoint_every == 0 or completed == config.steps:
                        run.save_checkpoint()
    except KeyboardInterrupt as interrupt:
        with _sigint_deferred():  # a second Ctrl-C must not cut the metrics line or the checkpoint short
            if isinstance(interrupt, _DeferredInterrupt) and interrupt.record is not None:
                run.emit(interrupt.record)  # the step the interrupt waited for was applied: report it
            log.warning("interrupted: saving the checkpoint of step %d", run.trainer.step_count)
            run.save_checkpoint()
        raise
    finally:
        bar.close()
    if config.eval_episodes and completed not in evaluated:
        run.emit(evaluate(run, config.eval_episodes, step=completed))
    return run.dir


def step_postfix(record: StepRecord) -> str:
    """The GRPO bar's figures for a step: mean reward, loss, and episode tokens (prompts, generations,
    observations) per second of the whole step (rollout + update)."""
    m = record.metrics
    episodes = sum((record.finish_reasons or {}).values())
    seconds = (record.rollout_seconds or 0.0) + m.seconds
    rate = record.episode_tokens_mean * episodes / seconds if seconds > 0 else 0.0
    return f"reward {m.reward_mean:.3f}, loss {m.loss:+.4f}, {rate:,.0f} tok/s"


NO_SIGNAL_STEPS = 3
"""Steps in a row, every group of them with uniform rewards, before the no-signal warning. A single such step is
ordinary: a policy that solves a fifth of its tasks gets a group of 4 with equal rewards 41 % of the time
(0.8^4 + 0.2^4), so a step of one or two groups often has nothing to learn from."""
NO_SIGNAL_GROUPS = 12
"""Groups, all with uniform rewards, that the warning's stretch must hold besides: at that solve rate 12 uniform
groups in a row happen by chance about once in 40,000 (0.41^12), so a stretch this long means the policy is not
learning, not that it was unlucky (3 steps of 4 groups; 12 steps of 1)."""


class LearningSignalWatch:
    """Warns when GRPO has had nothing to learn from for a stretch of steps: every group of the last
    ``NO_SIGNAL_STEPS`` steps (``NO_SIGNAL_GROUPS`` groups at least) had uniform rewards, so every advantage was zero
    and the updates changed nothing but the KL term (if any). Warns once per stretch; a step with a group whose
    members scored differently ends it."""

    def __init__(self, min_steps: int = NO_SIGNAL_STEPS, min_groups: int = NO_SIGNAL_GROUPS):
        self.min_steps = min_steps
        self.min_groups = min_groups
        self._stretch: list[tuple[int, list[float]]] = []  # (step, each group's common reward) without signal
        self._warned = False

    def observe(self, groups: Sequence[Sequence[Trajectory]], step: int) -> None:
        """Take the groups of ``step`` (0-based) into account; warn if they complete a stretch without signal."""
        common = [_common_reward(group) for group in groups]
        if not groups or any(reward is None for reward in common):
            self._stretch, self._warned = [], False
            return
        self._stretch.append((step, [reward for reward in common if reward is not None]))
        num_groups = sum(len(rewards) for _, rewards in self._stretch)
        if not self._warned and len(self._stretch) >= self.min_steps and num_groups >= self.min_groups:
            log.warning(no_signal_message(self._stretch))
            self._warned = True


def _common_reward(group: Sequence[Trajectory]) -> float | None:
    """The reward every member of ``group`` got, or None when they differ (the group has a learning signal)."""
    rewards = {t.reward or 0.0 for t in group}
    return rewards.pop() if len(rewards) == 1 else None


def no_signal_message(stretch: Sequence[tuple[int, Sequence[float]]]) -> str:
    """What a stretch of steps without learning signal saw (steps 1-based, as the bar and metrics count them), and
    what to check."""
    first, last = stretch[0][0] + 1, stretch[-1][0] + 1
    counts = Counter(reward for _, rewards in stretch for reward in rewards)
    if len(counts) == 1:
        seen = f"all {next(iter(counts)):g}"
    else:
        seen = ", ".join(f"{n} groups all {reward:g}" for reward, n in sorted(counts.items()))
    if set(counts) == {0.0}:
        hint = (
            "the policy solves none of these tasks: check that the warm start is long enough to teach the action "
            "format (warm_start.sft.steps, warm_start.episodes), that max_new_tokens fits an answer, or raise the "
            "sampling temperature or group size"
        )
    else:
        hint = "the members of each group scored alike: raise the group size or temperature, or use harder tasks"
    return (
        f"no learning signal in steps {first}-{last}: the {counts.total()} groups of these {len(stretch)} steps all "
        f"had uniform rewards ({seen}), so every advantage was zero and the updates changed nothing but the KL "
        f"term; {hint}"
    )


def group_prefix(run: Run, step: int, dp_rank: int) -> str:
    """The group ids' prefix of the groups ``dp_rank`` rolls out at step index ``step`` (from 0). The ids count
    steps from 1, as the metrics and the progress bar do (one process: ``step{step + 1}-g``)."""
    number = step + 1
    return f"step{number}-g" if run.ranks.dp == 1 else f"step{number}-dp{dp_rank}-g"


def rollout_and_train(run: Run, step: int, watch: LearningSignalWatch | None = None) -> StepRecord:
    """Roll out the step's groups (storing each whole), then one optimizer step on them; ``watch`` (on the writer)
    sees every dp rank's groups."""
    start = time.perf_counter()
    groups = _rollout_share(run, step)
    rollout_s = time.perf_counter() - start
    everyone = run.ranks.to_writer(groups) if run.ranks.mesh is not None else None
    if everyone is not None:
        _store_gathered(run, step, everyone)
    all_groups = groups if everyone is None else [g for part in everyone for g in part]
    if run.ranks.writes and watch is not None:
        watch.observe(all_groups, step)
    return _train_on(run, groups, lambda metrics: _step_record(metrics, all_groups, rollout_s))


def take_and_train(
    run: Run, step: int, rollouts: AsyncRollouts, watch: LearningSignalWatch | None = None
) -> StepRecord:
    """Take the step's groups from the rollout thread (or, resumed, from the store), store them (the writer, one
    transaction for the whole step, dropped groups too), then one optimizer step on the groups within the bound."""
    taken = rollouts.take(step)
    everyone = run.ranks.to_writer(taken) if run.ranks.mesh is not None else [taken]
    if everyone is not None and not taken.stored:  # (a step read from the store is there already)
        episodes = [t for part in everyone for g in part.every for t in g]
        run.store.add_episodes(stamp_train_version(episodes, run.trainer.policy_version), run_id=run.run_id)
    kept = taken.kept if everyone is None else [g for part in everyone for g in part.kept]
    if run.ranks.writes and watch is not None:
        watch.observe(kept, step)
    empty = run.ranks.from_writer(None if everyone is None else [r for r, part in enumerate(everyone) if not part.kept])
    if empty:  # (every rank raises alike: one that trained alone would wait for the others in a collective)
        raise RuntimeError(
            f"step {step + 1}: every group of dp rank{'s' if len(empty) > 1 else ''} {', '.join(map(str, empty))} "
            f"was sampled more than max_staleness={run.config.max_staleness} versions from version "
            f"{run.trainer.policy_version}: nothing to train on"
        )
    return _train_on(run, taken.kept, lambda metrics: _async_step_record(metrics, kept, taken, everyone))


def _train_on(run: Run, groups: list[list[Trajectory]], record: Callable[[StepMetrics], StepRecord]) -> StepRecord:
    """One optimizer step on ``groups`` (an update is applied whole or not at all) and its metrics line."""
    try:
        with _sigint_deferred():  # an update is applied whole or not at all
            metrics = run.trainer.train_step([run.trainer.group_from_trajectories(g) for g in groups])
            metrics = _step_metrics(run, metrics, len(groups))
    except _DeferredInterrupt as interrupt:
        # The update was applied and the checkpoint will record it: its metrics line must not be lost.
        interrupt.record = record(metrics)
        raise
    return record(metrics)


def _async_step_record(
    metrics: StepMetrics, kept: list[list[Trajectory]], taken: StepGroups, everyone: list[StepGroups] | None
) -> StepRecord:
    """The step's line with its staleness: over every dp rank's groups on the writer (elsewhere this rank's)."""
    parts = everyone if everyone is not None else [taken]
    staleness = [s for part in parts for s in part.staleness]
    return _step_record(metrics, kept, max(part.waited for part in parts)).model_copy(
        update={
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "groups_dropped_stale": sum(len(part.dropped) for part in parts),
        }
    )


def _rollout_share(run: Run, step: int) -> list[list[Trajectory]]:
    """This dp rank's groups of the step: rolled out by its first cp rank, the others computing with it (one
    process: stored as each group ends; several: stored by the writer once gathered), sent to its cp peers."""
    config, ranks = run.config, run.ranks
    prefix = group_prefix(run, step, ranks.dp_rank)
    groups: list[list[Trajectory]] = []
    sink = _SkipStored(run.store, run.run_id, prefix, run.trainer.policy_version) if ranks.mesh is None else None
    with run.sampling(step) as sampler:  # every rank enters together (FSDP2's gathers, the cp ranks' engine)
        if sampler is not None:
            groups = rollout_groups(
                run.env_factory,
                sampler,
                ranks.share(run.task_seeds(step)),
                config.group_size,
                run.limits,
                group_prefix=prefix,
                store=sink,
                run_id=run.run_id,
                progress=config.progress and ranks.writes,
            )
    return ranks.to_cp_peers(groups)


def _store_gathered(run: Run, step: int, everyone: list[list[list[Trajectory]]]) -> None:
    """The writer stores every dp rank's groups, each whole in one transaction (on resume, only what is not yet)."""
    for dp_rank, groups in enumerate(everyone):
        sink = _SkipStored(run.store, run.run_id, group_prefix(run, step, dp_rank), run.trainer.policy_version)
        for group in groups:
            sink.add_episodes(group, run_id=run.run_id)


def _step_metrics(run: Run, own: StepMetrics, num_groups: int) -> StepMetrics:
    """The step's metrics over every dp rank's groups (on the writer; elsewhere this rank's own)."""
    if run.ranks.mesh is None:
        return own
    parts = run.ranks.to_writer((own, num_groups))
    if parts is None:
        return own
    summed = run.config.trainer.loss.normalization == "batch"
    return merged_step_metrics([m for m, _ in parts], [n for _, n in parts], summed)


def _step_record(metrics: StepMetrics, groups: list[list[Trajectory]], rollout_s: float) -> StepRecord:
    episodes = [t for g in groups for t in g]
    return StepRecord(
        metrics=metrics,
        rollout_seconds=rollout_s,
        episode_tokens_mean=sum(t.num_tokens for t in episodes) / len(episodes),
        solved_fraction=sum(1 for t in episodes if (t.reward or 0) >= 1.0) / len(episodes),
        finish_reasons=dict(Counter(t.finish_reason for t in episodes)),
        **memory_metrics(),
    )


def evaluate(run: Run, num_episodes: int, step: int | None = None) -> EvalRecord:
    """Mean reward of one episode per held-out task with the current policy (not stored, not trained on); the dp
    ranks split the tasks and the writer pools their rewards."""
    ranks = run.ranks
    seeds = ranks.share([eval_task_seed(k) for k in range(num_episodes)])
    limits = run.limits
    rewards: list[float] = []
    with run.sampling(seed=eval_sampling_seed(ranks.dp_rank)) as sampler:
        if sampler is not None and seeds:
            progress = run.config.progress and ranks.writes
            groups = rollout_groups(
                run.env_factory, sampler, seeds, 1, limits, group_prefix="eval-", progress=progress, desc="eval"
            )
            rewards = [t.reward or 0.0 for g in groups for t in g]
    pooled = ranks.to_writer(rewards)
    rewards = rewards if pooled is None else [r for part in pooled for r in part]
    return EvalRecord(
        step=run.trainer.step_count if step is None else step,
        reward_mean=sum(rewards) / len(rewards),
        episodes=len(rewards),
        policy_version=run.trainer.policy_version,
    )


def memory_metrics() -> dict[str, int]:
    """Memory figures cheap enough for every step (``peak_bytes`` needs ``trainer.track_memory``): the process's
    peak resident set size and, when CUDA is in use, its peak allocation since the last call."""
    out: dict[str, int] = {}
    try:
        import resource
    except ImportError:  # not on Windows
        pass
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["rss_peak_bytes"] = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_peak_bytes"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    return out


class _DeferredInterrupt(KeyboardInterrupt):
    """Ctrl-C held until a block was done; ``record`` is the metrics line of the step it completed, if any."""

    record: StepRecord | None = None


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C until the block is done, then raise KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise _DeferredInterrupt


class _SkipStored:
    """On resume, the interrupted step is rolled out again and reproduces the episodes already stored: write only
    the ones that are not (per group, in finishing order)."""

    def __init__(self, store: Store, run_id: str, group_prefix: str, train_version: int):
        self.store = store
        self.stored = store.group_sizes(run_id, group_prefix)
        self.train_version = train_version

    def add_episodes(self, trajectories: list[Trajectory], run_id: str | None = None) -> list[int]:
        fresh = []
        for trajectory in trajectories:
            if self.stored.get(trajectory.group_id, 0) > 0:
                self.stored[trajectory.group_id] -= 1
            else:
                fresh.append(trajectory)
        return self.store.add_episodes(stamp_train_version(fresh, self.train_version), run_id=run_id) if fresh else []
