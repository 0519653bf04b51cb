"""NCCL's matching discipline, checked on CPU: a recorder of every process group call and an analyzer of the logs.

Gloo matches a point-to-point message by its sender and tag, so a schedule may post a pair's messages in any order
and still complete. NCCL ignores tags: it matches a pair's sends and receives in posting order, and a communicator
runs its operations (point-to-point and collectives) in posting order on one stream, so a send completes only once
the peer's stream reaches the matching receive (rendezvous) and a collective only once every member reaches it; the
operations of one ``batch_isend_irecv`` (an NCCL group) progress together. A schedule that gloo completes may hang on
NCCL. This module finds such schedules in CPU runs:

- ``record_to(log_dir)`` patches ``ProcessGroup``'s methods (what every ``torch.distributed`` call and FSDP2 reach),
  the functional collectives DTensor uses (``torch.distributed._functional_collectives``: they call C++ directly)
  and ``batch_isend_irecv``. Every call appends one JSON line to ``log_dir/rank{global rank}-{pid}-….jsonl`` before it
  runs (so a hung or killed run leaves its log): the communicator (``group``: its name, common to its members, and
  ``ranks``: its global ranks), the operation, the peer (a rank of that communicator) or root, the reduction, the
  tensors' shapes and dtypes, and the coalesced batch it belongs to. ``record_from_env`` does the same into
  ``$LONGSTRAW_COMM_LOG`` when it is set: every process that joins a job through ``launch.init_from_env`` calls it
  (``torchrun`` children inherit the variable). Importing this module, or the package, patches nothing.
- ``check(log_dir)`` reads every rank's log and returns the ``Violation``s: collectives of a communicator whose order,
  operation, root, reduction, shapes or dtypes differ between members; a pair's sends that do not match the peer's
  receives in posting order (count, shape, dtype, and tag: gloo pairs by tag, so a tag out of place is a message
  NCCL would deliver elsewhere); and the wait cycles of a simulation under NCCL's semantics.

The simulation keeps, per rank and communicator, a FIFO of steps (a collective, a point-to-point operation, or a
coalesced batch of them). The k-th send from a to b meets the k-th receive at b from a, the k-th collective of a
communicator the k-th of every member; an operation fires when it and its counterparts are in the steps at the heads
of their queues, and a step leaves its queue when all its operations fired. When work remains and nothing can fire,
each blocked rank waits for the peers whose counterparts are not at their heads: a cycle among them is a deadlock.
The check reports the first cycle in full, lets its operations through (as gloo's tags would) and goes on, so that
one run shows where every later deadlock of the schedule starts too. What the model leaves out:

- Host-side ordering between communicators: a blocking wait on one communicator before a call on another (or on the
  current CUDA stream, which NCCL's streams wait for) couples their queues; the model keeps them independent.
- Eager completion: NCCL may complete a small send before the receiver posts it (buffered in its channels), and
  PyTorch's NCCL backend may run a pair's unbatched point-to-point operations on a two-rank communicator of their
  own. The model demands rendezvous on one stream per communicator, which is stricter: the safe side.
- Calls that never reach ``ProcessGroup``'s Python methods or the functional collectives named above (the
  functional point-to-point ops meant for ``torch.compile``, the backward of autograd-tracked functional
  collectives, DTensor's ``shard_dim_alltoall``), and ``batch_isend_irecv`` imported by name before recording began.
- What the messages carry: only shapes and dtypes are compared, never values.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import distributed_c10d as c10d

LOG_ENV = "LONGSTRAW_COMM_LOG"
_WORLD_KEY = "longstraw/comm_log/world"  # in the default group's store: one token per world, shared by its ranks

# --- the recorder ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
    """What NCCL runs for a method (``kind``) and what each positional argument is: tensors read (``in``), written
    (``out``) or both (``inout``), the ``peer`` (a rank of the communicator), a ``tag``, split sizes (``splits``), or
    options (``opts``: a root, a reduction or an options object)."""

    kind: str
    roles: tuple[str, ...]


_P2P = ("send", "recv", "recv_anysource")
_IN_OUT = ("out", "in", "opts")
# ProcessGroup's methods, as torch 2.13's torch.distributed functions and FSDP2 call them (old names kept as aliases)
_PROCESS_GROUP_METHODS: dict[str, _Entry] = {
    "send": _Entry("send", ("in", "peer", "tag")),
    "recv": _Entry("recv", ("out", "peer", "tag")),
    "recv_anysource": _Entry("recv_anysource", ("out", "tag")),
    "broadcast": _Entry("broadcast", ("inout", "opts")),
    "allreduce": _Entry("allreduce", ("inout", "opts")),
    "allreduce_coalesced": _Entry("allreduce", ("inout", "opts")),
    "reduce": _Entry("reduce", ("inout", "opts")),
    "allgather": _Entry("allgather", _IN_OUT),
    "allgather_coalesced": _Entry("allgather", _IN_OUT),
    "all_gather_single": _Entry("allgather", _IN_OUT),
    "_allgather_base": _Entry("allgather", _IN_OUT),
    "all_gather_single_coalesced": _Entry("allgather", _IN_OUT),
    "allgather_into_tensor_coalesced": _Entry("allgather", _IN_OUT),
    "gather": _Entry("gather", _IN_OUT),
    "scatter": _Entry("scatter", _IN_OUT),
    "reduce_scatter": _Entry("reduce_scatter", _IN_OUT),
    "reduce_scatter_single": _Entry("reduce_scatter", _IN_OUT),
    "_reduce_scatter_base": _Entry("reduce_scatter", _IN_OUT),
    "reduce_scatter_single_coalesced": _Entry("reduce_scatter", _IN_OUT),
    "reduce_scatter_tensor_coalesced": _Entry("reduce_scatter", _IN_OUT),
    "alltoall": _Entry("alltoall", _IN_OUT),
    "all_to_all_single": _Entry("alltoall", ("out", "in", "splits", "splits", "opts")),
    "alltoall_base": _Entry("alltoall", ("out", "in", "splits", "splits", "opts")),
    "barrier": _Entry("barrier", ("opts",)),
    "monitored_barrier": _Entry("barrier", ("opts",)),
}
# functional collectives (DTensor's redistribute, FSDP's gradient reduce-scatter through it): name -> kind
_FUNCTIONAL_COLLECTIVES = {
    "broadcast": "broadcast",
    "all_reduce": "allreduce",
    "all_reduce_coalesced": "allreduce",
    "all_gather_single": "allgather",
    "all_gather_single_coalesced": "allgather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "all_to_all_single": "alltoall",
}
# the same collectives under the names torch had before the *_single ones (2.11: DTensor calls these); in later
# versions they are deprecated wrappers of the *_single ones, so only one of each pair is recorded
_FUNCTIONAL_FORMER_NAMES = {"all_gather_single": "all_gather_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


def _tensor_specs(value: Any) -> list[list[Any]]:
    """``[shape, dtype]`` of every tensor in ``value`` (a tensor or nested lists of them), in order."""
    if isinstance(value, torch.Tensor):
        return [[list(value.shape), str(value.dtype).removeprefix("torch.")]]
    if isinstance(value, list | tuple):
        return [spec for item in value for spec in _tensor_specs(item)]
    return []


def _reduction(op: Any) -> str:
    """A reduction's name: from a ``ReduceOp``, its ``RedOpType`` or a functional collective's string."""
    inner = getattr(op, "op", op)
    return str(getattr(inner, "name", inner)).upper()


def _options(value: Any) -> dict[str, Any]:
    """The root and reduction an options argument carries (an options object, a bare root, or a bare reduction)."""
    if isinstance(value, int):
        return {"root": value}
    if isinstance(value, dist.ReduceOp | dist.ReduceOp.RedOpType):
        return {"reduce_op": _reduction(value)}
    found: dict[str, Any] = {}
    if getattr(value, "rootRank", None) is not None:
        found["root"] = value.rootRank
    if getattr(value, "reduceOp", None) is not None:
        found["reduce_op"] = _reduction(value.reduceOp)
    return found


def _describe_call(entry: _Entry, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The log fields of a ProcessGroup method call: tensors by role, peer, tag, root and reduction."""
    event: dict[str, Any] = {"inputs": [], "outputs": []}
    for role, value in zip(entry.roles, args, strict=False):
        if role in ("in", "inout"):
            event["inputs"] += _tensor_specs(value)
        elif role == "out":
            event["outputs"] += _tensor_specs(value)
        elif role in ("peer", "tag"):
            event[role] = int(value)
        elif role == "opts":
            event.update(_options(value))
    for value in kwargs.values():  # e.g. barrier(opts=...)
        event.update(_options(value))
    return event


def _communicator(group: dist.ProcessGroup) -> dict[str, Any]:
    """The identity every member of ``group`` shares: its name and its global ranks."""
    try:
        ranks = c10d.get_process_group_ranks(group)
    except (KeyError, ValueError, RuntimeError):  # a group torch.distributed does not track
        ranks = list(range(group.size()))
    return {"group": group.group_name, "ranks": ranks}


@dataclass
class _File:
    """One process's log for one world: its descriptor, written unbuffered (a killed process loses nothing)."""

    fd: int
    default_group: Any


class _Recorder:
    """The patches (installed while some destination is active) and each process's log files."""

    def __init__(self) -> None:
        self.destinations: list[Path] = []
        self._originals: dict[tuple[Any, str], Any] = {}
        self._files: dict[tuple[int, Path], _File] = {}
        self._lock = threading.Lock()
        self._batch = threading.local()  # depth and id of the coalesced batch being posted on this thread
        self._batches = 0

    # --- what is written
    def record(self, group: dist.ProcessGroup, op: str, kind: str, fields: dict[str, Any]) -> None:
        if not self.destinations:
            return
        event = {"op": op, "kind": kind, **_communicator(group), **fields}
        if getattr(self._batch, "depth", 0):
            event["batch"] = self._batch.id
        line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
        with self._lock:
            os.write(self._file().fd, line)

    def _file(self) -> _File:
        """This process's log in the active destination, opened at its first event (after a fork: the child's own)
        and again when the default group changes (a new world)."""
        key = (os.getpid(), self.destinations[-1])
        default_group = c10d._get_default_group() if dist.is_initialized() else None
        current = self._files.get(key)
        if current is None or current.default_group is not default_group:
            if current is not None:
                os.close(current.fd)
            current = self._open(key[1], default_group)
            self._files[key] = current
        return current

    def _open(self, directory: Path, default_group: Any) -> _File:
        rank = dist.get_rank() if default_group is not None else 0
        size = dist.get_world_size() if default_group is not None else 1
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"rank{rank}-{os.getpid()}-{time.time_ns()}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        header = {"world": _world_token(default_group), "rank": rank, "size": size, "pid": os.getpid()}
        os.write(fd, (json.dumps(header) + "\n").encode())
        return _File(fd, default_group)

    # --- coalesced batches
    def begin_batch(self) -> None:
        depth = getattr(self._batch, "depth", 0)
        if depth == 0:
            self._batches += 1
            self._batch.id = self._batches
        self._batch.depth = depth + 1

    def end_batch(self) -> None:
        self._batch.depth = max(0, getattr(self._batch, "depth", 0) - 1)

    # --- the patches
    def install(self) -> None:
        pg = dist.ProcessGroup
        for name, entry in _PROCESS_GROUP_METHODS.items():
            if hasattr(pg, name):
                self._patch(pg, name, _recorded_method(self, name, entry, getattr(pg, name)))
        self._patch(pg, "_start_coalescing", _opening_batch(self, pg._start_coalescing))
        self._patch(pg, "_end_coalescing", _closing_batch(self, pg._end_coalescing))
        for current, kind in _FUNCTIONAL_COLLECTIVES.items():
            name = current if hasattr(funcol, current) else _FUNCTIONAL_FORMER_NAMES.get(current, current)
            if hasattr(funcol, name):  # (the set differs between torch versions)
                self._patch(funcol, name, _recorded_functional(self, name, kind, getattr(funcol, name)))
        batched = _recorded_batch(self, c10d.batch_isend_irecv)
        self._patch(c10d, "batch_isend_irecv", batched)
        self._patch(dist, "batch_isend_irecv", batched)

    def _patch(self, owner: Any, name: str, replacement: Any) -> None:
        # a class's own attribute as it is stored (read through the class, a pybind11 method comes back unbound:
        # set back, it would no longer bind to the instance), or none where it is inherited
        own = vars(owner).get(name, _INHERITED) if isinstance(owner, type) else getattr(owner, name)
        self._originals[(owner, name)] = own
        setattr(owner, name, replacement)

    def uninstall(self) -> None:
        for (owner, name), original in self._originals.items():
            if original is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._originals.clear()
        for file in self._files.values():
            os.close(file.fd)
        self._files.clear()


_INHERITED = object()  # (a patched class attribute that was its base class's)


def _world_token(default_group: Any) -> str:
    """A token every rank of this world reads alike (the first rank to ask sets it in the default group's store),
    telling apart the worlds of several runs that log into one directory."""
    candidate = f"{socket.gethostname()}-{os.getpid()}-{time.time_ns()}"
    if default_group is None:
        return candidate
    try:
        return c10d._get_default_store().compare_set(_WORLD_KEY, "", candidate).decode()
    except (RuntimeError, AttributeError, NotImplementedError):  # a store without compare-and-set
        return f"world-of-{dist.get_world_size()}"


def _recorded_method(recorder: _Recorder, name: str, entry: _Entry, original: Any) -> Callable[..., Any]:
    def recorded(self: dist.ProcessGroup, *args: Any, **kwargs: Any) -> Any:
        recorder.record(self, name, entry.kind, _describe_call(entry, args, kwargs))
        return original(self, *args, **kwargs)

    recorded.__name__ = name
    return recorded


def _opening_batch(recorder: _Recorder, original: Any) -> Callable[..., Any]:
    """``ProcessGroup._start_coalescing``: the calls until ``_end_coalescing`` form one batch (an NCCL group)."""

    def _start_coalescing(self: dist.ProcessGroup, *args: Any, **kwargs: Any) -> Any:
        recorder.begin_batch()
        return original(self, *args, **kwargs)

    return _start_coalescing


def _closing_batch(recorder: _Recorder, original: Any) -> Callable[..., Any]:
    def _end_coalescing(self: dist.ProcessGroup, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            recorder.end_batch()

    return _end_coalescing


def _recorded_batch(recorder: _Recorder, original: Callable[..., Any]) -> Callable[..., Any]:
    """``batch_isend_irecv``: its operations form one batch, also on backends without coalescing (gloo)."""

    @functools.wraps(original)
    def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> Any:
        recorder.begin_batch()
        try:
            return original(p2p_op_list)
        finally:
            recorder.end_batch()

    return batch_isend_irecv


def _recorded_functional(recorder: _Recorder, name: str, kind: str, original: Any) -> Callable[..., Any]:
    signature = inspect.signature(original)
    first = next(iter(signature.parameters))  # the input tensor(s)

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs).arguments
        group = c10d._resolve_process_group(funcol._resolve_group_name(bound["group"], bound.get("tag", "")))
        fields: dict[str, Any] = {"inputs": _tensor_specs(bound[first]), "outputs": []}
        if "src" in bound:
            fields["root"] = int(bound["src"])
        if "reduceOp" in bound:
            fields["reduce_op"] = _reduction(bound["reduceOp"])
        recorder.record(group, f"functional.{name}", kind, fields)
        return original(*args, **kwargs)

    return recorded


_RECORDER = _Recorder()


class Recording:
    """An active destination of the recorder (``record_to``): ``stop`` (or leaving its ``with`` block) restores the
    one before it, and the original methods when none is left."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.active = True

    def stop(self) -> None:
        if not self.active:
            return
        self.active = False
        _RECORDER.destinations.remove(self.log_dir)
        if not _RECORDER.destinations:
            _RECORDER.uninstall()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def record_to(log_dir: str | os.PathLike[str]) -> Recording:
    """Record every process group call of this process (and of processes forked from it while recording) into
    ``log_dir``, from now until the returned ``Recording`` stops (use it as a context manager, or call ``stop``)."""
    directory = Path(log_dir).resolve()
    if not _RECORDER.destinations:
        _RECORDER.install()
    _RECORDER.destinations.append(directory)
    return Recording(directory)


def record_from_env() -> Recording | None:
    """Start recording into ``$LONGSTRAW_COMM_LOG`` when it is set (and not already recorded into)."""
    log_dir = os.environ.get(LOG_ENV)
    if not log_dir or (_RECORDER.destinations and _RECORDER.destinations[-1] == Path(log_dir).resolve()):
        return None
    return record_to(log_dir)


# --- the analyzer ------------------------------------------------------------------------------------------------

ViolationKind = Literal["collective mismatch", "message mismatch", "unmatched", "wait cycle", "unsupported"]


@dataclass(frozen=True)
class Violation:
    """A departure from NCCL's discipline: what kind, on which communicator, and the operations involved."""

    kind: ViolationKind
    communicator: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind} on {self.communicator}: {self.detail}"


@dataclass(frozen=True)
class Communicator:
    """A process group as all its members name it: its group name and its global ranks."""

    name: str
    ranks: tuple[int, ...]

    def __str__(self) -> str:
        return f"communicator {self.name!r} (ranks {', '.join(map(str, self.ranks))})"


@dataclass(eq=False)
class Op:
    """One recorded call as the analyzer reads it: ``rank`` is global, ``index`` its place in that rank's log, and
    ``peer`` / ``root`` global ranks."""

    rank: int
    index: int
    communicator: Communicator
    op: str
    kind: str
    peer: int | None = None
    root: int | None = None
    reduce_op: str | None = None
    tag: int | None = None
    inputs: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    outputs: list[tuple[tuple[int, ...], str]] = field(default_factory=list)
    batch: int | None = None

    @property
    def tensors(self) -> list[tuple[tuple[int, ...], str]]:
        """What a point-to-point operation moves: a send's inputs, a receive's outputs."""
        return self.inputs if self.kind == "send" else self.outputs

    def __str__(self) -> str:
        where = {"send": f" to rank {self.peer}", "recv": f" from rank {self.peer}"}.get(self.kind, "")
        root = f" root {self.root}" if self.root is not None else ""
        tag = f" tag {self.tag}" if self.tag else ""
        batch = " (batched)" if self.batch is not None else ""
        shapes = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in (self.inputs or self.outputs))
        return f"#{self.index} {self.op}{where}{root}{tag} [{shapes}]{batch}"


def _read_op(rank: int, index: int, record: dict[str, Any]) -> Op:
    ranks = tuple(record["ranks"])
    peer, root = record.get("peer"), record.get("root")
    return Op(
        rank,
        index,
        Communicator(record["group"], ranks),
        record["op"],
        record["kind"],
        peer=ranks[peer] if peer is not None else None,
        root=ranks[root] if root is not None and 0 <= root < len(ranks) else root,
        reduce_op=record.get("reduce_op"),
        tag=record.get("tag"),
        inputs=[(tuple(shape), dtype) for shape, dtype in record.get("inputs", [])],
        outputs=[(tuple(shape), dtype) for shape, dtype in record.get("outputs", [])],
        batch=record.get("batch"),
    )


World = dict[int, list[Op]]  # global rank -> its operations in posting order


def read_logs(log_dir: str | os.PathLike[str]) -> list[World]:
    """Every world that logged into ``log_dir`` (runs started one after another may share it)."""
    worlds: dict[str, World] = {}
    for path in sorted(Path(log_dir).glob("*.jsonl")):
        lines = path.read_text().splitlines()
        if not lines:
            continue
        header = json.loads(lines[0])
        ops = worlds.setdefault(header["world"], {}).setdefault(header["rank"], [])
        for line in lines[1:]:
            if line.strip():  # a process killed mid-write may leave a partial last line
                with contextlib.suppress(json.JSONDecodeError):
                    ops.append(_read_op(header["rank"], len(ops), json.loads(line)))
    return list(worlds.values())


def check(log_dir: str | os.PathLike[str], allow_unfinished: bool = False) -> list[Violation]:
    """The violations of NCCL's discipline in the logs of ``log_dir``. ``allow_unfinished``: a run that stops a
    rank on purpose (a failure test) leaves operations without counterparts; report only mismatches and cycles."""
    violations: list[Violation] = []
    for world in read_logs(log_dir):
        violations += check_world(world, allow_unfinished)
    return violations


def check_world(world: World, allow_unfinished: bool = False) -> list[Violation]:
    """The violations among one world's ranks, communicator by communicator."""
    by_communicator: dict[Communicator, dict[int, list[Op]]] = defaultdict(lambda: defaultdict(list))
    for rank, ops in sorted(world.items()):
        for op in ops:
            by_communicator[op.communicator][rank].append(op)
    violations: list[Violation] = []
    for communicator, members in by_communicator.items():
        violations += _unsupported(communicator, members)
        violations += _collective_mismatches(communicator, members, allow_unfinished)
        violations += _message_mismatches(communicator, members, allow_unfinished)
        violations += Simulation(communicator, members).cycles()
    return violations


def _unsupported(communicator: Communicator, members: dict[int, list[Op]]) -> list[Violation]:
    found = [op for ops in members.values() for op in ops if op.kind == "recv_anysource"]
    return [
        Violation("unsupported", str(communicator), f"rank {op.rank} posts {op}: NCCL has no receive from any source")
        for op in found[:1]
    ]


# what must agree between the members of a collective, beyond its kind
_AGREEING_FIELDS: dict[str, tuple[str, ...]] = {
    "broadcast": ("inputs", "root"),
    "allreduce": ("inputs", "reduce_op"),
    "reduce": ("inputs", "root", "reduce_op"),
    "allgather": ("inputs", "outputs"),
    "reduce_scatter": ("inputs", "outputs", "reduce_op"),
    "gather": ("inputs", "root"),  # only the root passes outputs
    "scatter": ("outputs", "root"),  # only the root passes inputs
    "alltoall": ("dtypes",),  # uneven splits make the shapes differ
    "barrier": (),
}


def _signature(op: Op) -> tuple[Any, ...]:
    fields = _AGREEING_FIELDS.get(op.kind, ("inputs", "outputs", "root", "reduce_op"))
    dtypes = tuple(sorted({dtype for _, dtype in op.inputs + op.outputs}))
    values = (dtypes if name == "dtypes" else getattr(op, name) for name in fields)
    return (op.kind, *(tuple(v) if isinstance(v, list) else v for v in values))


def _collectives(ops: list[Op]) -> list[Op]:
    return [op for op in ops if op.kind not in _P2P]


def _collective_mismatches(
    communicator: Communicator, members: dict[int, list[Op]], allow_unfinished: bool
) -> list[Violation]:
    """The first collective at which the members' sequences differ (operation, root, reduction, shapes, dtypes),
    or at which some member has none left."""
    sequences = {rank: _collectives(members.get(rank, [])) for rank in communicator.ranks}
    longest = max(len(ops) for ops in sequences.values())
    for k in range(longest):
        at_k = {rank: ops[k] for rank, ops in sequences.items() if k < len(ops)}
        if len({_signature(op) for op in at_k.values()}) > 1:
            posts = "; ".join(f"rank {rank} posts {op}" for rank, op in at_k.items())
            return [Violation("collective mismatch", str(communicator), f"collective {k} differs: {posts}")]
        if len(at_k) < len(sequences) and not allow_unfinished:
            missing = sorted(set(sequences) - set(at_k))
            first = next(iter(at_k.values()))
            detail = f"collective {k} ({first}) is never posted by rank(s) {', '.join(map(str, missing))}"
            return [Violation("unmatched", str(communicator), detail)]
    return []


def _message_mismatches(
    communicator: Communicator, members: dict[int, list[Op]], allow_unfinished: bool
) -> list[Violation]:
    """Per ordered pair, the first send whose receive (the same place in the receiver's order) differs in shape,
    dtype or tag, and sends or receives left without a counterpart."""
    sends, recvs = _pair_sequences(members)
    violations: list[Violation] = []
    for pair in sorted(set(sends) | set(recvs)):
        sent, received = sends.get(pair, []), recvs.get(pair, [])
        for k, (send, recv) in enumerate(zip(sent, received, strict=False)):
            if send.tensors != recv.tensors or send.tag != recv.tag:
                detail = f"message {k} from rank {pair[0]} to rank {pair[1]}: rank {pair[0]} posts {send}, "
                detail += f"rank {pair[1]} receives it with {recv}"
                if send.tag != recv.tag:  # gloo pairs them by tag, so it delivered another message than NCCL would
                    detail += " (gloo pairs messages by tag, NCCL by posting order)"
                violations.append(Violation("message mismatch", str(communicator), detail))
                break
        if len(sent) != len(received) and not allow_unfinished:
            detail = f"rank {pair[0]} posts {len(sent)} sends to rank {pair[1]}, which posts {len(received)} receives"
            violations.append(Violation("unmatched", str(communicator), detail))
    return violations


def _pair_sequences(members: dict[int, list[Op]]) -> tuple[dict[tuple[int, int], list[Op]], ...]:
    """Sends and receives per ordered pair (sender, receiver), in posting order."""
    sends: dict[tuple[int, int], list[Op]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[Op]] = defaultdict(list)
    for rank, ops in members.items():
        for op in ops:
            if op.kind == "send" and op.peer is not None:
                sends[(rank, op.peer)].append(op)
            elif op.kind == "recv" and op.peer is not None:
                recvs[(op.peer, rank)].append(op)
    return sends, recvs


class Simulation:
    """One communicator under NCCL's semantics: per member a FIFO of steps (an operation, or a coalesced batch),
    run until nothing can fire (see the module's docstring)."""

    def __init__(self, communicator: Communicator, members: dict[int, list[Op]]):
        self.communicator = communicator
        self.queues = {rank: _steps(members.get(rank, [])) for rank in communicator.ranks}
        self.step_of: dict[int, tuple[int, int]] = {}  # id(op) -> (rank, step)
        for rank, steps in self.queues.items():
            for s, step in enumerate(steps):
                for op in step:
                    self.step_of[id(op)] = (rank, s)
        self.counterparts = _counterparts(communicator, members)
        self.head = dict.fromkeys(self.queues, 0)
        self.fired: set[int] = set()
        self._left = {(rank, s): len(step) for rank, steps in self.queues.items() for s, step in enumerate(steps)}

    def run(self) -> list[list[tuple[Op, Op]]]:
        """Fire what can fire; at a deadlock, note its cycle and let the cycle's operations through (as gloo's tags
        would) to look for the next. The cycles, in the order met."""
        found: list[list[tuple[Op, Op]]] = []
        entered = [rank for rank, steps in self.queues.items() if steps]
        while True:
            self._fire_available(entered)
            cycle = _find_cycle(
                {rank: [(op, o) for op in ops for o in self.waits(op)] for rank, ops in self.blocked().items()}
            )
            if cycle is None:
                return found
            found.append(cycle)
            entered = [rank for op, _ in cycle for rank in self._fire(op)]

    def _fire_available(self, entered: list[int]) -> None:
        """Fire operations whose counterparts sit in head steps until none does (each rank in ``entered`` has a
        new head step to try)."""
        while entered:
            rank = entered.pop()
            if self.head[rank] < len(self.queues[rank]):
                for op in self.queues[rank][self.head[rank]]:
                    if self._ready(op):
                        entered += self._fire(op)

    def _available(self, op: Op) -> bool:
        rank, s = self.step_of[id(op)]
        return self.head[rank] == s and id(op) not in self.fired

    def _ready(self, op: Op) -> bool:
        others = self.counterparts.get(id(op))
        return others is not None and self._available(op) and all(self._available(o) for o in others)

    def _fire(self, op: Op) -> list[int]:
        """Fire ``op`` with its counterparts; the ranks whose queue advanced (past every step left with nothing)."""
        advanced = []
        for fired in [op, *self.counterparts.get(id(op), [])]:
            if id(fired) in self.fired:
                continue
            self.fired.add(id(fired))
            rank, s = self.step_of[id(fired)]
            self._left[(rank, s)] -= 1
            moved = False
            while self.head[rank] < len(self.queues[rank]) and self._left[(rank, self.head[rank])] == 0:
                self.head[rank] += 1
                moved = True
            if moved:
                advanced.append(rank)
        return advanced

    def blocked(self) -> dict[int, list[Op]]:
        """Per rank that still has work, the operations of its head step that have not fired."""
        return {
            rank: [op for op in steps[self.head[rank]] if id(op) not in self.fired]
            for rank, steps in self.queues.items()
            if self.head[rank] < len(steps)
        }

    def waits(self, op: Op) -> list[Op]:
        """The counterparts ``op`` waits for: posted, but not at the heads of their ranks' queues."""
        return [other for other in self.counterparts.get(id(op), []) if not self._available(other)]

    def cycles(self) -> list[Violation]:
        """The first deadlock in full, and where the ones after it start. (Ranks blocked without a cycle wait for a
        counterpart that is never posted: the count checks report those.)"""
        deadlocks = _deadlocks(self.run())
        if not deadlocks:
            return []
        detail = "; ".join(
            f"rank {op.rank} waits at {op} for rank {other.rank}'s {other}" for op, other in deadlocks[0]
        )
        if len(deadlocks) > 1:
            starts = ", ".join(f"rank {cycle[0][0].rank} at {cycle[0][0]}" for cycle in deadlocks[1:4])
            more = ", ..." if len(deadlocks) > 4 else ""
            detail += f". Let through, {len(deadlocks) - 1} more follow, from {starts}{more}"
        return [Violation("wait cycle", str(self.communicator), detail)]


def _deadlocks(cycles: list[list[tuple[Op, Op]]]) -> list[list[tuple[Op, Op]]]:
    """The cycles, each counted once for the parts of one message: a cycle whose operations follow the previous
    cycle's on each rank, to the same peers with the same tags, continues it."""
    found: list[list[tuple[Op, Op]]] = []
    for cycle, before in zip(cycles, [None, *cycles], strict=False):
        if before is None or not _continues(cycle, before):
            found.append(cycle)
    return found


def _continues(cycle: list[tuple[Op, Op]], before: list[tuple[Op, Op]]) -> bool:
    return len(cycle) == len(before) and all(
        (op.rank, op.kind, op.peer, op.tag, op.index) == (b.rank, b.kind, b.peer, b.tag, b.index + 1)
        for (op, _), (b, _) in zip(cycle, before, strict=True)
    )


def _find_cycle(waits: dict[int, list[tuple[Op, Op]]]) -> list[tuple[Op, Op]] | None:
    """A cycle in the graph of ranks, each blocked op pointing at the rank of a counterpart it waits for: the
    (op, counterpart) pairs along it, from its lowest rank."""
    done: set[int] = set()

    def visit(rank: int, path: list[tuple[Op, Op]], on_path: dict[int, int]) -> list[tuple[Op, Op]] | None:
        on_path[rank] = len(path)
        for op, other in waits.get(rank, []):
            if other.rank in on_path:
                return [*path, (op, other)][on_path[other.rank] :]
            if other.rank not in done:
                found = visit(other.rank, [*path, (op, other)], on_path)
                if found:
                    return found
        del on_path[rank]
        done.add(rank)
        return None

    for start in sorted(waits):
        if start not in done:
            found = visit(start, [], {})
            if found:
                return found
    return None


def _steps(ops: list[Op]) -> list[list[Op]]:
    """A rank's queue on one communicator: consecutive operations of one coalesced batch form one step."""
    steps: list[list[Op]] = []
    for op in ops:
        if op.batch is not None and steps and steps[-1][-1].batch == op.batch:
            steps[-1].append(op)
        else:
            steps.append([op])
    return steps


def _counterparts(communicator: Communicator, members: dict[int, list[Op]]) -> dict[int, list[Op]]:
    """For each operation that can fire, the operations of the other ranks it fires with (id(op) -> ops): the k-th
    send from a to b with the k-th receive at b from a, the k-th collective with every member's k-th."""
    found: dict[int, list[Op]] = {}
    sends, recvs = _pair_sequences(members)
    for pair, sent in sends.items():
        for send, recv in zip(sent, recvs.get(pair, []), strict=False):
            found[id(send)], found[id(recv)] = [recv], [send]
    sequences = {rank: _collectives(members.get(rank, [])) for rank in communicator.ranks}
    for k in range(min(len(ops) for ops in sequences.values())):
        at_k = [ops[k] for ops in sequences.values()]
        for op in at_k:
            found[id(op)] = [other for other in at_k if other is not op]
    return found
