"""Asynchronous GRPO (``max_staleness``): the next steps' rollouts run while a step trains, with bounded staleness.

The smallest design that keeps every guarantee of the synchronous loop (after AReaL's ``max_head_offpolicyness``,
NeMo-RL's in-flight weight updates and verl's / slime's partial rollouts):

- **One rollout thread** (per dp rank, on its first cp rank) rolls the steps out in order — step k's tasks and
  sampling seed are the synchronous loop's — and hands each step's groups to the training loop through a queue.
- **Bounded staleness, by admission.** The thread starts step k's rollout once the weights it samples with are at
  version ``k - max_staleness`` or later. Step k trains at version k, so no token it trains on was sampled more than
  ``max_staleness`` versions before. With 0 a step waits for its own weights: the synchronous loop, bit for bit.
- **Partial rollouts.** An episode goes on across weight updates: the thread takes the newest weights between turns
  (never within one), and every assistant turn records the version that sampled it (``Segment.policy_version``).
  In process the members' states are first recomputed with the new weights (NeMo-RL's
  ``recompute_kv_cache_after_weight_updates``), so a turn of version v is a draw of π_v given its whole context; a
  served policy reads each turn's prompt afresh anyway.
- **Off-policy correction per token**, from the behaviour logprobs recorded at sampling (``LossConfig.importance``):
  the clipped ratio against them (``ratio``), truncated importance weights (``tis``) or IcePop's masked ones
  (``icepop``), as offline replay uses.
- **Groups beyond the bound are dropped and counted** (``groups_dropped_stale`` in the step's metrics), never trained
  on. Admission makes that happen only when the served weights went back to an older version (another trainer
  pushed to the same server): the check guards the bound rather than enforces it.
- **Weights.** In process the thread samples with its own copy of the policy's compute weights
  (``WeightSnapshot``): the training loop publishes each step's weights into a host-side staging copy (it never waits
  for a turn to end), and the thread loads them between turns. Sharded (FSDP2), the copy is assembled a part at a
  time from the shards, every rank taking part (``parallel.fsdp.whole_parts``). A served policy gets each step's
  weights pushed while it keeps sampling (``weight_sync``; the server loads them between requests); an asynchronous
  run checks first that the server takes pushed weights and reports, with each completion, the version that sampled
  it (else a ``ConfigError`` / ``SamplerError`` says which it lacks).
- **Store and resume.** The training loop stores each step's groups (dropped ones too) in one transaction when it
  takes them, each episode with ``info["train_version"]``: the version that trained on it (staleness = that minus a
  turn's version). A resumed run trains again, from the store, the steps stored after its checkpoint — the same
  episodes, so the same versions — and rolls out the rest. Its ``max_staleness`` must be the one the run was
  started with (``Run`` refuses another).

Costs: the sampling copy (and its host staging copy) holds the compute weights twice more; with context
parallelism the thread samples on the first cp rank alone, without its cp peers (long prompts that need them to
sample: use a served policy).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from longstraw_agents.app.config import ConfigError
from longstraw_agents.app.seeds import sampling_seed
from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.lora import with_adapters_of
from longstraw_agents.models.presets import build_model
from longstraw_agents.parallel.fsdp import compute_dtype, is_sharded, whole_parts
from longstraw_agents.rollout import rollout_groups
from longstraw_agents.sampler import Generation
from longstraw_agents.store import TRAIN_VERSION
from longstraw_agents.torch_sampler import TorchHandle, TorchSampler
from longstraw_agents.trajectory import Trajectory
from longstraw_agents.weight_sync import WeightSyncError

if TYPE_CHECKING:
    from longstraw_agents.app.run import Run

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 60.0
"""How long closing waits for the rollout thread to reach its next turn (it checks between turns)."""


# --- staleness ------------------------------------------------------------------------------------------------------
def oldest_version(trajectory: Trajectory) -> int:
    """The oldest weights that sampled a turn of ``trajectory`` (its start's version when no turn says)."""
    turns = [s.policy_version for s in trajectory.segments if s.policy_version is not None]
    return min(turns, default=trajectory.policy_version)


def newest_version(trajectory: Trajectory) -> int:
    """The newest weights that sampled a turn of ``trajectory`` (its start's version when no turn says)."""
    turns = [s.policy_version for s in trajectory.segments if s.policy_version is not None]
    return max(turns, default=trajectory.policy_version)


def group_staleness(group: Sequence[Trajectory], version: int) -> int:
    """Policy versions between the oldest weights that sampled a token of ``group`` and ``version``."""
    return version - min(oldest_version(t) for t in group)


def from_the_future(group: Sequence[Trajectory], version: int) -> bool:
    """A turn of ``group`` was sampled by weights newer than ``version``: weights this run has not made (another
    trainer pushed to the same server)."""
    return max(newest_version(t) for t in group) > version


@dataclass
class StepGroups:
    """A step's groups as the training loop takes them: those it trains on (``kept``, with each one's staleness)
    and those beyond the bound (``dropped``); ``waited``: seconds it waited for them; ``stored``: they were read from
    the store (a resumed run's step), not rolled out now."""

    kept: list[list[Trajectory]]
    dropped: list[list[Trajectory]] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    waited: float = 0.0
    stored: bool = False

    @property
    def every(self) -> list[list[Trajectory]]:
        return [*self.kept, *self.dropped]


def within_bound(groups: Sequence[list[Trajectory]], version: int, max_staleness: int) -> StepGroups:
    """Split ``groups`` at ``version``: those sampled within ``max_staleness`` versions, and the others (beyond the
    bound, or sampled in part by weights newer than ``version``, which this run has not made)."""
    out = StepGroups(kept=[])
    for group in groups:
        staleness = group_staleness(group, version)
        if staleness > max_staleness or from_the_future(group, version):
            out.dropped.append(group)
        else:
            out.kept.append(group)
            out.staleness.append(staleness)
    if out.dropped:
        log.warning(
            "dropped %d of %d groups sampled more than max_staleness=%d versions before version %d, or after it (were "
            "the served weights changed by someone else?)",
            len(out.dropped),
            len(groups),
            max_staleness,
            version,
        )
    return out


# --- the weights the rollout thread samples with -------------------------------------------------------------------
class VersionGate:
    """The newest policy version published to the rollout thread; the thread waits on it to start a step."""

    def __init__(self, version: int):
        self.changed = threading.Condition()
        self.published = version
        self.closed = False

    def publish_version(self, version: int) -> None:
        with self.changed:
            self.published = version
            self.changed.notify_all()

    def wait_for(self, version: int) -> bool:
        """Block until ``version`` (or a later one) is published; False when the gate closed first."""
        with self.changed:
            self.changed.wait_for(lambda: self.published >= version or self.closed)
            return not self.closed

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()


class WeightSnapshot(VersionGate):
    """The rollout thread's copy of the policy's compute weights (``model``, read by that thread only).

    The training loop ``publish``es each new version into a staging copy on the host — it never waits for a turn —
    and the thread ``take``s the newest between turns: a swap of the whole model at once, never mid-turn."""

    def __init__(self, model: nn.Module, version: int):
        super().__init__(version)
        self.model = model
        self.version = version  # the one ``model`` holds
        self._tensors = publishable(model)
        self._staged = {name: t.detach().to("cpu", copy=True) for name, t in self._tensors.items()}

    def publish(self, parts: Iterable[dict[str, Tensor]], version: int) -> None:
        """Copy the weights of ``version`` (by name, e.g. ``whole_parts``) into the staging copy."""
        with self.changed:
            for part in parts:
                for name, tensor in part.items():
                    self._staged[name].copy_(tensor.detach())
            self.published = version
            self.changed.notify_all()

    def take(self, force: bool = False) -> bool:
        """Load the newest published weights into ``model`` (the rollout thread, between turns); True if they
        changed. ``force``: load them even when of the version it holds (its first weights)."""
        with self.changed:
            if self.published == self.version and not force:
                return False
            with torch.no_grad():
                for name, tensor in self._tensors.items():
                    tensor.copy_(self._staged[name])
            self.version = self.published
            return True


def publishable(model: nn.Module) -> dict[str, Tensor]:
    """What ``whole_parts`` yields of ``model``, by name: its parameters (tied ones once) and persistent buffers."""
    tensors: dict[str, Tensor] = dict(model.named_parameters())
    persistent = {name for name in model.state_dict() if name not in tensors}
    tensors |= {name: b for name, b in model.named_buffers() if name in persistent}
    return tensors


def sampling_copy(computed: nn.Module, device: torch.device | str) -> nn.Module:
    """A frozen, unsharded model for the rollout thread, of the trainer's compute model: a copy of it, or, sharded,
    one of its architecture in its compute dtype (its weights come with the first ``publish``)."""
    if not is_sharded(computed):
        return copy.deepcopy(computed).eval().requires_grad_(False)
    dtype = compute_dtype(computed) or next(computed.parameters()).dtype
    return architecture_copy(computed, dtype).to(device)


def architecture_copy(computed: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A frozen model of ``computed``'s architecture in ``dtype``, LoRA adapters included (PEFT's parameter names:
    ``publish`` copies ``computed``'s tensors in by name), its values not yet set."""
    model = build_model(computed.config, dtype=dtype)  # type: ignore[arg-type]
    return with_adapters_of(model, computed).requires_grad_(False)


# --- the rollout thread's samplers ----------------------------------------------------------------------------------
class Stopped(Exception):
    """The pipeline closed while its rollout thread was in a rollout."""


class WorkerSampler:
    """The rollout thread's sampler: ``inner``'s calls, refused (``Stopped``) once the pipeline closes. For a served
    policy that is all: the server samples each turn with the weights it holds and says which."""

    def __init__(self, inner: Any, stop: threading.Event):
        self.inner = inner
        self.stop = stop

    @property
    def policy_version(self) -> int:
        return int(self.inner.policy_version)

    def check(self) -> None:
        if self.stop.is_set():
            raise Stopped

    def before_turn(self, handles: Sequence[Any]) -> None:
        """Called before each turn of ``handles`` (and each fork, with none)."""
        self.check()

    def fork(self, prompt_ids: Sequence[int], n: int) -> list[Any]:
        self.before_turn(())
        return list(self.inner.fork(prompt_ids, n))

    def generate(self, handle: Any, max_new_tokens: int | None = None) -> Generation:
        self.before_turn([handle])
        return self.inner.generate(handle, max_new_tokens)

    def generate_batch(self, handles: Sequence[Any], max_new_tokens: Sequence[int | None]) -> list[Generation]:
        self.before_turn(handles)
        if hasattr(self.inner, "generate_batch"):
            return list(self.inner.generate_batch(handles, list(max_new_tokens)))
        return [self.inner.generate(h, n) for h, n in zip(handles, max_new_tokens, strict=True)]

    def append(self, handle: Any, ids: Sequence[int]) -> None:
        self.inner.append(handle, ids)

    def replace(self, handle: Any, ids: Sequence[int], kept: int) -> None:
        self.inner.replace(handle, ids, kept)

    def replace_batch(self, handles: Sequence[Any], contexts: Sequence[Sequence[int]], kept: Sequence[int]) -> None:
        if hasattr(self.inner, "replace_batch"):
            self.inner.replace_batch(handles, contexts, kept)
            return
        for handle, context, k in zip(handles, contexts, kept, strict=True):
            self.inner.replace(handle, context, k)

    def num_tokens(self, handle: Any) -> int:
        return int(self.inner.num_tokens(handle))

    def close(self) -> None:
        if hasattr(self.inner, "close"):
            self.inner.close()


class SnapshotSampler(WorkerSampler):
    """In process: a ``TorchSampler`` over the ``WeightSnapshot``'s model. Before each turn it takes the newest
    published weights and recomputes, with them, the state of every member computed with older ones (the members of
    one fork capture their shared prompt once), so that each turn is sampled by one version given its whole context."""

    def __init__(self, inner: TorchSampler, snapshot: WeightSnapshot, stop: threading.Event):
        super().__init__(inner, stop)
        self.snapshot = snapshot
        self.computed_with: dict[int, tuple[TorchHandle, int]] = {}  # id(handle) -> (handle, version of its state)

    def before_turn(self, handles: Sequence[Any]) -> None:
        self.check()
        if self.snapshot.take():
            self.inner.policy_version = self.snapshot.version
        version = self.inner.policy_version
        stale = [h for h in handles if self.computed_with[id(h)][1] != version]
        for members in _by_first_mark(stale):
            self.inner.replace_batch(members, [list(h.history) for h in members], [0] * len(members))
        self._computed(stale)

    def fork(self, prompt_ids: Sequence[int], n: int) -> list[Any]:
        handles = super().fork(prompt_ids, n)
        self._computed(handles)
        return handles

    def _computed(self, handles: Iterable[TorchHandle]) -> None:
        for handle in handles:
            self.computed_with[id(handle)] = (handle, self.inner.policy_version)


def _by_first_mark(handles: Sequence[TorchHandle]) -> list[list[TorchHandle]]:
    """``handles`` by their first mark (a fork's members share it: their prompt is then captured once)."""
    clusters: dict[int, list[TorchHandle]] = {}
    for handle in handles:
        clusters.setdefault(id(handle.marks[0]) if handle.marks else id(handle), []).append(handle)
    return list(clusters.values())


# --- the rollout thread ---------------------------------------------------------------------------------------------
@dataclass
class _Rolled:
    step: int
    groups: list[list[Trajectory]]


class RolloutWorker:
    """A thread that rolls out ``steps`` in order, each once ``gate`` has published ``step - max_staleness``, and
    queues each step's groups (or the error that stopped it) for ``get``."""

    def __init__(
        self,
        roll_out: Callable[[int], list[list[Trajectory]]],
        gate: VersionGate,
        steps: range,
        max_staleness: int,
    ):
        self.roll_out, self.gate, self.steps, self.max_staleness = roll_out, gate, steps, max_staleness
        self.results: queue.Queue[_Rolled | BaseException] = queue.Queue()
        # the current CUDA device is a thread's own: the thread samples on its rank's, not on GPU 0
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.thread = threading.Thread(target=self._run, name="longstraw-rollouts", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.cuda_device is not None:
                torch.cuda.set_device(self.cuda_device)
            for step in self.steps:
                if not self.gate.wait_for(step - self.max_staleness):
                    return
                self.results.put(_Rolled(step, self.roll_out(step)))
        except Stopped:
            return
        except BaseException as err:  # noqa: BLE001 - handed to the training loop, which raises it
            self.results.put(err)

    def get(self, step: int) -> list[list[Trajectory]]:
        """Step ``step``'s groups, once rolled out (the rollout's error, raised here, if it failed)."""
        while True:
            try:
                item = self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.thread.is_alive():
                    raise RuntimeError(f"the rollout thread ended before rolling out step {step + 1}") from None
                continue
            if isinstance(item, BaseException):
                raise item
            if item.step != step:
                raise RuntimeError(f"the rollout thread rolled out step {item.step + 1} where {step + 1} was due")
            return item.groups

    def stop(self, stop: threading.Event) -> None:
        stop.set()
        self.gate.close()
        if self.thread.is_alive():
            self.thread.join(JOIN_TIMEOUT_S)
            if self.thread.is_alive():
                log.warning("the rollout thread did not stop within %.0f s", JOIN_TIMEOUT_S)


# --- the pipeline -----------------------------------------------------------------------------------------------------
class AsyncRollouts:
    """A run's asynchronous rollouts: ``take(step)`` gives the training loop a step's groups, ``publish()`` hands the
    rollout thread the weights of the step just taken. Every rank makes the same calls (``take`` and ``publish`` hold
    collectives on a mesh); the ranks that roll out (``Ranks.rolls_out``) run a rollout thread.

    group_prefix: ``(step, dp_rank) -> group id prefix`` of the steps' groups (the synchronous loop's).
    """

    def __init__(self, run: Run, steps: range, group_prefix: Callable[[int, int], str]):
        bound = run.config.max_staleness
        if bound is None:
            raise ValueError("AsyncRollouts needs config.max_staleness (None is the synchronous loop)")
        self.run, self.max_staleness, self.group_prefix = run, bound, group_prefix
        self.stop_event = threading.Event()
        self.first_rolled = run.ranks.from_writer(self._first_unstored(steps) if run.ranks.writes else steps.start)
        version = run.trainer.policy_version
        self.snapshot: WeightSnapshot | None = None
        self.gate: VersionGate = VersionGate(version)
        self.engine: Engine | None = None
        if run.served is not None:
            self._check_server(version)
        else:
            self._make_snapshot(version)
        self.worker: RolloutWorker | None = None
        if run.ranks.rolls_out:
            rolled = range(self.first_rolled, steps.stop)
            self.worker = RolloutWorker(self._roll_out, self.gate, rolled, bound)
            self.worker.start()

    # --- the training loop's side ---------------------------------------------------------------------------
    def take(self, step: int) -> StepGroups:
        """This rank's groups of ``step`` (rolled out, or read from the store when the run resumed before it),
        split at the trainer's version by the staleness bound."""
        start = time.perf_counter()
        stored = step < self.first_rolled
        groups = self._stored_share(step) if stored else self._rolled_share(step)
        taken = within_bound(groups, self.run.trainer.policy_version, self.max_staleness)
        taken.waited, taken.stored = time.perf_counter() - start, stored
        return taken

    def publish(self) -> None:
        """Hand the rollout thread the trainer's weights (its current version): copied into its snapshot, or pushed
        to the server; every rank takes part (a sharded model is gathered a part at a time)."""
        trainer, ranks = self.run.trainer, self.run.ranks
        version = trainer.policy_version
        if self.run.served is not None:
            self.run.served.push(trainer.engine.model, version)
            self.gate.publish_version(version)
            return
        computed = trainer.engine.model
        if is_sharded(computed):
            parts: Iterable[dict[str, Tensor]] = whole_parts(computed, keep=ranks.rolls_out)
        else:
            parts = [publishable(computed)] if ranks.rolls_out else []
        if self.snapshot is not None and ranks.rolls_out:
            self.snapshot.publish(parts, version)
        else:
            for _ in parts:  # (a rank that only takes part in the gathers)
                pass

    def close(self) -> None:
        """Stop the rollout thread (it stops at its next turn; what it was rolling out is dropped, never stored)."""
        if self.worker is not None:
            self.worker.stop(self.stop_event)

    # --- the rollout thread's side --------------------------------------------------------------------------
    def _roll_out(self, step: int) -> list[list[Trajectory]]:
        """Step ``step``'s groups of this dp rank, as the synchronous loop rolls them out (its tasks, its sampling
        seed, its group ids), with the weights the thread holds between turns."""
        run = self.run
        config, ranks = run.config, run.ranks
        sampler = self._sampler(step)
        try:
            return rollout_groups(
                run.env_factory,
                sampler,
                ranks.share(run.task_seeds(step)),
                config.group_size,
                run.limits,
                group_prefix=self.group_prefix(step, ranks.dp_rank),
                run_id=run.run_id,
                progress=False,  # (the training loop's bar counts the steps)
            )
        finally:
            sampler.close()

    def _sampler(self, step: int) -> WorkerSampler:
        run = self.run
        seed = sampling_seed(run.config.seed, step, run.ranks.dp_rank)
        sampling = run.config.sampling.model_copy(update={"seed": seed})
        if run.served is not None:
            served = run.served.following_sampler(self.gate.published, run.stop_ids, sampling)
            return WorkerSampler(served, self.stop_event)
        snapshot, engine = self.snapshot, self.engine
        assert snapshot is not None and engine is not None
        snapshot.take()
        inner = TorchSampler(engine, run.stop_ids, sampling, policy_version=snapshot.version, keep_marks=run.keep_marks)
        return SnapshotSampler(inner, snapshot, self.stop_event)

    def _engine_config(self) -> EngineConfig:
        """The trainer's engine settings (one process: the synchronous loop's sampling, exactly), or the chunk size
        alone where they describe a context-parallel engine (the thread samples without its cp peers)."""
        trainer = self.run.trainer
        if trainer.engine.shards is None:
            return trainer.engine.config
        return EngineConfig(chunk_size=trainer.config.chunk_size)

    # --- assembly -------------------------------------------------------------------------------------------
    def _make_snapshot(self, version: int) -> None:
        """The rollout thread's weights and engine (on the ranks that roll out): a copy of the trainer's compute
        model, or, sharded, one assembled from the shards (every rank taking part)."""
        trainer, ranks = self.run.trainer, self.run.ranks
        if ranks.rolls_out:
            model = sampling_copy(trainer.engine.model, trainer.accelerator.device)
            self.snapshot = WeightSnapshot(model, version)
            self.gate = self.snapshot
            self.engine = Engine(model, self._engine_config())
        if is_sharded(trainer.engine.model):
            self.publish()
            if self.snapshot is not None:
                self.snapshot.take(force=True)

    def _check_server(self, version: int) -> None:
        """The server takes pushed weights (the trainer's, pushed now) and reports which version answers: an
        asynchronous run pushes while it samples. A server that does not is a ``ConfigError`` before any step."""
        served = self.run.served
        assert served is not None
        try:
            served.push(self.run.trainer.engine.model, version)
        except WeightSyncError as err:
            raise ConfigError(
                f"max_staleness: asynchronous GRPO loads each step's weights into the server while it samples, but "
                f"{served.spec.base_url} cannot update its weights: {err}"
            ) from None

    # --- where a step's groups come from ----------------------------------------------------------------------
    def _rolled_share(self, step: int) -> list[list[Trajectory]]:
        groups = self.worker.get(step) if self.worker is not None else []
        return self.run.ranks.to_cp_peers(groups)

    def _stored_share(self, step: int) -> list[list[Trajectory]]:
        """This rank's groups of ``step`` as the store holds them: the writer reads every dp rank's, in the order
        they were stored (the order they were trained in), and sends each rolling-out rank its own."""
        ranks = self.run.ranks
        everyone = [self._stored_groups(step, r) for r in range(ranks.dp)] if ranks.writes else None
        if ranks.mesh is None:
            assert everyone is not None
            return everyone[0]
        mine: list[Any] = [None]
        if ranks.rolls_out:
            dist.scatter_object_list(mine, everyone, group_src=0, group=ranks.mesh.dp_group)
        return ranks.to_cp_peers(mine[0])

    def _stored_groups(self, step: int, dp_rank: int) -> list[list[Trajectory]]:
        run = self.run
        prefix = self.group_prefix(step, dp_rank)
        where = "run_id = ? AND substr(group_id, 1, ?) = ?"
        records = run.store.group_records(where, [run.run_id, len(prefix), prefix])
        return [group.trajectories for group in records]

    def _first_unstored(self, steps: range) -> int:
        """The first step of ``steps`` whose groups the store does not hold (the writer): the steps before it were
        stored after the checkpoint, each whole (one transaction)."""
        run = self.run
        for step in steps:
            sizes = [
                n
                for r in range(run.ranks.dp)
                for n in run.store.group_sizes(run.run_id, self.group_prefix(step, r)).values()
            ]
            if len(sizes) < run.config.groups_per_step or any(n != run.config.group_size for n in sizes):
                return step
        return steps.stop


@contextlib.contextmanager
def async_rollouts(run: Run, steps: range, group_prefix: Callable[[int, int], str]) -> Iterator[AsyncRollouts | None]:
    """The run's ``AsyncRollouts`` over ``steps`` (None: ``max_staleness`` unset, the synchronous loop), closed
    however the block ends."""
    if run.config.max_staleness is None or not steps:
        yield None
        return
    rollouts = AsyncRollouts(run, steps, group_prefix)
    try:
        yield rollouts
    finally:
        rollouts.close()


def stamp_train_version(trajectories: Iterable[Trajectory], version: int) -> list[Trajectory]:
    """``trajectories`` with ``info["train_version"]`` set: the policy version that trains on them."""
    stamped = list(trajectories)
    for trajectory in stamped:
        trajectory.info[TRAIN_VERSION] = version
    return stamped


__all__ = [
    "TRAIN_VERSION",
    "AsyncRollouts",
    "RolloutWorker",
    "SnapshotSampler",
    "StepGroups",
    "VersionGate",
    "WeightSnapshot",
    "WorkerSampler",
    "async_rollouts",
    "group_staleness",
    "oldest_version",
    "stamp_train_version",
    "within_bound",
]
