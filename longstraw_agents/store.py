"""The trajectory store: token-exact episodes in one SQLite file, safe for several writer processes.

Layout (plain column types, so ``sqlite-utils rows trajectories.db episodes`` and any SQLite client can read it):

- ``runs``: one row per training or rollout run: ``config`` (JSON), ``model`` and ``tokenizer`` identity, notes.
- ``episodes``: one row per trajectory: env id, group id, seed, policy version, reward, finish reason, token and
  segment counts, ``info`` (JSON). Indexed on ``group_id``, ``run_id`` and ``policy_version`` for offline replay.
- ``segments``: one row per segment, primary key ``(episode_id, idx)``. ``token_ids`` is a little-endian int32
  blob, ``loss_mask`` a uint8 blob (0/1), ``logprobs`` a little-endian float32 blob (NULL when unknown),
  ``tool_calls`` JSON, ``policy_version`` the version of the weights that sampled the segment (an assistant turn;
  NULL when unknown). Read a blob back with ``np.frombuffer(blob, "<i4")`` / ``"<f4"``. Nothing is pickled.
- ``context_edits``: one row per ``ContextEdit`` of an episode that edited its context, primary key
  ``(episode_id, idx)`` with ``idx`` its place in ``Trajectory.edits``: ``before`` (the log length when it
  happened), ``removed`` (a JSON list of segment indices), ``replacement`` (a segment index, NULL for none), ``kind``.
  An episode that only appended has no row.

Any trajectory an environment produced is accepted. A policy can write a lone UTF-16 surrogate (``"\\ud800"`` in
tool-call JSON, decoded by the tool parser into a one-character string that UTF-8, and so SQLite's TEXT, cannot
hold). A segment's text holding one is stored as its ``surrogatepass`` UTF-8 bytes (a blob in the ``text`` column,
decoded the same way on reading); tool calls and ``info`` holding one are stored as ASCII JSON, whose ``\\ud800``
escapes ``json.loads`` restores. Only the id and reason strings of an episode (``env_id``, ``group_id``,
``finish_reason``: SQL keys, compared as text) are *escaped*: a lone surrogate becomes the six characters
``\\ud800`` (Python's ``backslashreplace``), and ``info["store_escaped_surrogates"]`` lists the fields that were
altered. Token ids are never touched; the caller's trajectory is not modified.

Reading is checked row by row: a damaged segment (a blob of the wrong length or type, negative ids, a loss mask
other than 0/1, an unknown role, broken tool-call JSON...) or context edit (one that does not fit the episode's
segments) raises ``StoreError`` naming its episode and row.

The schema version lives in ``PRAGMA user_version`` and the file is marked with ``PRAGMA application_id``; a store
written by a newer version of this package is refused rather than misread. A store of an older version is upgraded
in place when opened (its new tables and version in one transaction; versions of this package that predate it then
refuse it). A store this process cannot write (a read-only file) is read as it is: version 1 holds no edits.

Concurrency and durability: the file is in WAL mode, so readers never block writers. Every write runs in one
``BEGIN IMMEDIATE`` transaction: an episode, all its segments and edits become visible together or not at all, even when
the writer is killed with SIGKILL, and concurrent writers queue on the busy timeout instead of failing.
``synchronous=NORMAL`` is the WAL setting SQLite recommends: a committed episode survives a crash of the process;
only a power loss can drop the last few commits, and it never corrupts the file. A ``Store`` object belongs to
one thread; open one per process (or thread) that writes.
"""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import re
import secrets
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

import numpy as np
from sqlite_utils import Database

from longstraw_agents.trajectory import ROLES, ContextEdit, EditKind, Segment, Trajectory

SCHEMA_VERSION = 3
# "LSTR" in the SQLite header: marks the file as a longstraw store for `file(1)` and for `Store.open`.
APPLICATION_ID = int.from_bytes(b"LSTR", "big")
# Writers wait this long for the write lock before giving up; a commit takes milliseconds, so only a stuck
# process holding a transaction open would exhaust it.
BUSY_TIMEOUT_S = 60.0
TABLES = ("runs", "episodes", "segments", "context_edits")
_ADDED_IN_VERSION = {"context_edits": 2}
"""The tables a store of an earlier version lacks (the others are in every version), by the version that added them."""
QueryParams = Sequence[Any] | dict[str, Any]
"""Values of a query's placeholders: a sequence for ``?``, a dict for ``:name`` (sqlite3 takes no other mapping)."""

_VERSION_1_SCHEMA = """
CREATE TABLE runs (
    id TEXT PRIMARY KEY,
    created_at TEXT NOT NULL,
    config TEXT NOT NULL,
    model TEXT NOT NULL,
    tokenizer TEXT NOT NULL,
    notes TEXT NOT NULL DEFAULT ''
);
CREATE TABLE episodes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT REFERENCES runs(id),
    env_id TEXT NOT NULL,
    group_id TEXT NOT NULL,
    seed INTEGER,
    policy_version INTEGER NOT NULL,
    reward REAL,
    finish_reason TEXT NOT NULL,
    num_tokens INTEGER NOT NULL,
    num_segments INTEGER NOT NULL,
    created_at TEXT NOT NULL,
    info TEXT NOT NULL
);
CREATE TABLE segments (
    episode_id INTEGER NOT NULL REFERENCES episodes(id),
    idx INTEGER NOT NULL,
    role TEXT NOT NULL,
    turn INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    token_ids BLOB NOT NULL CHECK (length(token_ids) = 4 * num_tokens),
    loss_mask BLOB NOT NULL CHECK (length(loss_mask) = num_tokens),
    logprobs BLOB CHECK (logprobs IS NULL OR length(logprobs) = 4 * num_tokens),
    text TEXT NOT NULL,
    tool_calls TEXT,
    PRIMARY KEY (episode_id, idx)
);
CREATE INDEX idx_episodes_group_id ON episodes(group_id);
CREATE INDEX idx_episodes_run_id ON episodes(run_id);
CREATE INDEX idx_episodes_policy_version ON episodes(policy_version);
"""
_CONTEXT_EDITS_SCHEMA = """
CREATE TABLE context_edits (
    episode_id INTEGER NOT NULL REFERENCES episodes(id),
    idx INTEGER NOT NULL,
    before INTEGER NOT NULL,
    removed TEXT NOT NULL,
    replacement INTEGER,
    kind TEXT NOT NULL,
    PRIMARY KEY (episode_id, idx)
);
"""
_TURN_VERSIONS_SCHEMA = """
ALTER TABLE segments ADD COLUMN policy_version INTEGER;
"""
_SCHEMA = _VERSION_1_SCHEMA + _CONTEXT_EDITS_SCHEMA + _TURN_VERSIONS_SCHEMA
_UPGRADES = {2: _CONTEXT_EDITS_SCHEMA, 3: _TURN_VERSIONS_SCHEMA}
"""The statements that turn a store of version ``v - 1`` into one of version ``v`` (a new store runs ``_SCHEMA``:
version 1's tables and every upgrade's)."""

_INT64 = np.iinfo(np.int64)
ESCAPED_SURROGATES = "store_escaped_surrogates"
"""The ``info`` key listing the id / reason fields whose lone surrogates ``add_episodes`` escaped (absent when none
were)."""
_SURROGATE = re.compile("[\ud800-\udfff]")
TRAIN_VERSION = "train_version"
"""The ``info`` key of an episode a training run stored: the policy version that trained on it (a turn's staleness is
that minus the version that sampled the turn, ``Segment.policy_version``)."""


class StoreError(Exception):
    """The store cannot be opened, read or written as asked; the message says why and names the file."""


@dataclass(frozen=True)
class RunRecord:
    """One row of the ``runs`` table."""

    id: str
    created_at: str
    config: dict[str, Any]
    model: str
    tokenizer: str
    notes: str = ""


@dataclass(frozen=True)
class EpisodeRecord:
    """A stored trajectory with what the store adds to it: its id, run and creation time."""

    id: int
    run_id: str | None
    created_at: str
    trajectory: Trajectory


@dataclass(frozen=True)
class EpisodeGroup:
    """One GRPO group as stored: the episodes of one run that share a (non-empty) group id, by episode id."""

    run_id: str | None
    group_id: str
    records: tuple[EpisodeRecord, ...]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [record.trajectory for record in self.records]


@dataclass(frozen=True)
class GroupSummary:
    """One group of a selection, summarised from its ``episodes`` rows (no segment is read).

    first_episode: the id of its first episode (it names the group within the store); rewarded: how many members
    have a reward (reward statistics are over those, None when none has); tokens: summed over members; max_tokens:
    the longest member's; finish_reasons: how many members ended for each reason, most frequent first.
    """

    run_id: str | None
    group_id: str
    first_episode: int
    members: int
    env_ids: tuple[str, ...]
    min_version: int
    max_version: int
    reward_mean: float | None
    reward_min: float | None
    reward_max: float | None
    rewarded: int
    tokens: int
    max_tokens: int
    finish_reasons: dict[str, int]


@dataclass(frozen=True)
class Totals:
    """What a selection of episodes amounts to (versions are None when it is empty)."""

    episodes: int
    groups: int
    tokens: int
    min_version: int | None
    max_version: int | None


@dataclass(frozen=True)
class EnvTotals:
    """One environment's share of a selection; reward statistics are None when no episode has a reward."""

    env_id: str
    episodes: int
    groups: int
    tokens: int
    reward_mean: float | None
    reward_min: float | None
    reward_max: float | None


# ---------------------------------------------------------------------------------------------------------------
# Encoding: numpy arrays <-> fixed little-endian blobs, metadata <-> strict JSON.


def _ids_to_blob(ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(ids, dtype="<i4").tobytes()


def _mask_to_blob(mask: np.ndarray) -> bytes:
    return np.ascontiguousarray(mask, dtype=np.uint8).tobytes()


def _logprobs_to_blob(logprobs: np.ndarray | None) -> bytes | None:
    return None if logprobs is None else np.ascontiguousarray(logprobs, dtype="<f4").tobytes()


class _Damaged(ValueError):
    """A stored value that cannot be what its column holds; re-raised as a StoreError naming the row."""


def _sql_type(value: Any) -> str:
    return {str: "text", int: "an integer", float: "a real", type(None): "NULL"}.get(type(value), type(value).__name__)


def _blob_to_array(blob: Any, dtype: str, count: int, *, what: str) -> np.ndarray:
    """The ``count`` values of ``dtype`` in ``blob``, or ``_Damaged`` saying what is wrong with it."""
    if not isinstance(blob, bytes):
        raise _Damaged(f"{what} is {_sql_type(blob)} where a blob belongs")
    itemsize = np.dtype(dtype).itemsize
    if len(blob) % itemsize:
        raise _Damaged(f"{what}: blob of {len(blob)} bytes is not a whole number of {dtype} values")
    if len(blob) != count * itemsize:
        raise _Damaged(f"{what} holds {len(blob) // itemsize} values for a segment of {count} tokens")
    return np.frombuffer(blob, dtype=dtype)


# -- lone surrogates ----------------------------------------------------------------------------------------------


def _escaped_field(value: str, name: str, altered: list[str]) -> str:
    """An id or reason string with its lone surrogates escaped as ``\\udXXX`` (``name`` added to ``altered``)."""
    if not _SURROGATE.search(value):
        return value
    altered.append(name)
    return value.encode("utf-8", "backslashreplace").decode("utf-8")


def _text_value(text: Any) -> Any:
    """What the ``text`` column holds: the text, or its ``surrogatepass`` UTF-8 bytes when a lone surrogate (which
    UTF-8 text cannot hold) is in it."""
    if isinstance(text, str) and _SURROGATE.search(text):
        return text.encode("utf-8", "surrogatepass")
    return text


def _stored_text(value: Any) -> str:
    """The ``text`` column's value: text, or the blob of a text with lone surrogates (see ``_text_value``); the
    column's TEXT affinity stores any other value as text."""
    if not isinstance(value, bytes):
        return str(value)
    try:
        return value.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as err:
        raise _Damaged(f"text is a blob that is not UTF-8 ({err.reason} at byte {err.start})") from None


def _json_default(value: Any) -> Any:
    # Environments often leave numpy scalars and arrays in `info`; store them as the plain JSON they stand for.
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def _to_json(value: Any, *, what: str) -> str:
    """Strict JSON (no NaN/Infinity), so SQLite's json functions and other readers accept every stored value. A
    value holding a lone surrogate is written as ASCII JSON: its ``\\udXXX`` escapes read back as the surrogate."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False, default=_json_default)
        if _SURROGATE.search(text):
            text = json.dumps(value, ensure_ascii=True, allow_nan=False, default=_json_default)
    except (TypeError, ValueError) as err:
        raise StoreError(f"{what} cannot be stored as JSON: {err}") from err
    return text


def _int64(value: Any, *, what: str, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if not isinstance(value, numbers.Integral):
        raise StoreError(f"{what} must be an integer{' or None' if optional else ''}, got {value!r}")
    value = int(value)
    if not _INT64.min <= value <= _INT64.max:
        raise StoreError(f"{what} {value} does not fit SQLite's 64-bit INTEGER")
    return value


def _reward(value: Any) -> float | None:
    if value is None:
        return None
    if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        # SQLite turns NaN into NULL, which would silently read back as "no reward".
        raise StoreError(f"reward must be a finite number or None, got {value!r}")
    return float(value)


def _episode_row(trajectory: Trajectory, run_id: str | None, created_at: str) -> dict[str, Any]:
    """The ``episodes`` row; lone surrogates in the id and reason strings are escaped and listed in ``info``."""
    for name in ("env_id", "group_id", "finish_reason"):
        if not isinstance(getattr(trajectory, name), str):
            raise StoreError(f"trajectory.{name} must be a str, got {getattr(trajectory, name)!r}")
    if not isinstance(trajectory.info, Mapping):
        raise StoreError(f"trajectory.info must be a dict, got {type(trajectory.info).__name__}")
    altered: list[str] = []
    names = {name: _escaped_field(getattr(trajectory, name), name, altered) for name in ("env_id", "group_id")}
    finish_reason = _escaped_field(trajectory.finish_reason, "finish_reason", altered)
    info = dict(trajectory.info)
    if altered:
        earlier = info.get(ESCAPED_SURROGATES, [])
        info[ESCAPED_SURROGATES] = [*(earlier if isinstance(earlier, list) else [earlier]), *altered]
    return {
        "run_id": run_id,
        **names,
        "seed": _int64(trajectory.seed, what="seed", optional=True),
        "policy_version": _int64(trajectory.policy_version, what="policy_version"),
        "reward": _reward(trajectory.reward),
        "finish_reason": finish_reason,
        "num_tokens": trajectory.num_tokens,
        "num_segments": len(trajectory.segments),
        "created_at": created_at,
        "info": _to_json(info, what="trajectory.info"),
    }


def _segment_row(idx: int, segment: Segment) -> dict[str, Any]:
    if not isinstance(segment, Segment):
        raise StoreError(f"segment {idx} is a {type(segment).__name__}, not a Segment")
    calls = segment.tool_calls
    return {
        "idx": idx,
        "role": segment.role,
        "turn": _int64(segment.turn, what=f"segment {idx} turn"),
        "num_tokens": len(segment),
        "token_ids": _ids_to_blob(segment.token_ids),
        "loss_mask": _mask_to_blob(segment.loss_mask),
        "logprobs": _logprobs_to_blob(segment.logprobs),
        "text": _text_value(segment.text),
        "tool_calls": None if calls is None else _to_json(calls, what=f"segment {idx}"),
        "policy_version": _int64(segment.policy_version, what=f"segment {idx} policy_version", optional=True),
    }


_EDIT_KINDS: tuple[EditKind, ...] = get_args(EditKind)


def _edit_row(idx: int, edit: ContextEdit) -> dict[str, Any]:
    if not isinstance(edit, ContextEdit):
        raise StoreError(f"context edit {idx} is a {type(edit).__name__}, not a ContextEdit")
    return {
        "idx": idx,
        "before": _int64(edit.before, what=f"context edit {idx} before"),
        "removed": json.dumps([_int64(k, what=f"context edit {idx} removed segment") for k in edit.removed]),
        "replacement": _int64(edit.replacement, what=f"context edit {idx} replacement", optional=True),
        "kind": edit.kind,
    }


def _edits_misfit(trajectory: Trajectory) -> str | None:
    """Why the trajectory's context edits cannot be replayed on its segments; None when they can (or there are none)."""
    if trajectory.edits:
        try:
            trajectory.physical_sequences(keep_empty=True)
        except ValueError as err:
            return f"its context edits do not fit its {len(trajectory)} segments: {err}"
    return None


@dataclass(frozen=True)
class _EncodedEpisode:
    episode: dict[str, Any]
    segments: list[dict[str, Any]]
    edits: list[dict[str, Any]]


def _encode(trajectory: Trajectory, run_id: str | None) -> _EncodedEpisode:
    if not isinstance(trajectory, Trajectory):
        raise StoreError(f"expected a Trajectory, got {type(trajectory).__name__}")
    segments = [_segment_row(idx, seg) for idx, seg in enumerate(trajectory.segments)]
    edits = [_edit_row(idx, edit) for idx, edit in enumerate(trajectory.edits)]
    if misfit := _edits_misfit(trajectory):
        raise StoreError(f"cannot store the trajectory: {misfit}")
    return _EncodedEpisode(episode=_episode_row(trajectory, run_id, _utc_now()), segments=segments, edits=edits)


def _segment_from_row(episode_id: int, row: Mapping[str, Any]) -> Segment:
    """The stored segment; ``StoreError`` naming the episode and the segment when the row is damaged."""
    try:
        count = _stored_int(row["num_tokens"], "num_tokens")
        if count < 0:
            raise _Damaged(f"num_tokens is {count}")
        ids = _blob_to_array(row["token_ids"], "<i4", count, what="token_ids")
        if ids.size and ids.min() < 0:
            raise _Damaged(f"token_ids holds negative ids: {ids[ids < 0][:8].tolist()}")
        mask = _blob_to_array(row["loss_mask"], "u1", count, what="loss_mask")
        if mask.size and mask.max() > 1:
            raise _Damaged(f"loss_mask holds values other than 0 and 1: {sorted(set(mask.tolist()) - {0, 1})[:8]}")
        logprobs = row["logprobs"]
        if row["role"] not in ROLES:
            raise _Damaged(f"role is {row['role']!r}, not one of {ROLES}")
        text = _stored_text(row["text"])
        return Segment(
            role=row["role"],
            token_ids=ids.astype(np.int32),
            loss_mask=mask.astype(bool),
            logprobs=None if logprobs is None else _blob_to_array(logprobs, "<f4", count, what="logprobs").copy(),
            turn=_stored_int(row["turn"], "turn"),
            text=text,
            tool_calls=_stored_tool_calls(row["tool_calls"]),
            policy_version=_stored_version(row.get("policy_version")),  # (absent from a store read as version < 3)
        )
    except _Damaged as err:
        raise StoreError(f"episode {episode_id} segment {row['idx']} is damaged: {err}") from None


def _stored_int(value: Any, what: str) -> int:
    if not isinstance(value, int):
        raise _Damaged(f"{what} is {_sql_type(value)} where an integer belongs")
    return value


def _stored_version(value: Any) -> int | None:
    return None if value is None else _stored_int(value, "policy_version")


def _stored_json(value: Any, what: str) -> Any:
    if not isinstance(value, str):
        raise _Damaged(f"{what} is {_sql_type(value)} where JSON text belongs")
    try:
        return json.loads(value)
    except json.JSONDecodeError as err:
        raise _Damaged(f"{what} is not valid JSON ({err})") from None


def _stored_tool_calls(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    calls = _stored_json(value, "tool_calls")
    if not isinstance(calls, list) or not all(isinstance(call, dict) for call in calls):
        raise _Damaged(f"tool_calls is {_preview(value)}, not a JSON list of objects")
    return calls


def _preview(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _edit_from_row(episode_id: int, row: Mapping[str, Any]) -> ContextEdit:
    """The stored context edit; ``StoreError`` naming the episode and the edit when the row is damaged."""
    try:
        removed = _stored_json(row["removed"], "removed")
        if not isinstance(removed, list) or not all(type(k) is int and k >= 0 for k in removed):
            raise _Damaged(f"removed is {_preview(row['removed'])}, not a JSON list of segment indices")
        replacement = row["replacement"]
        if row["kind"] not in _EDIT_KINDS:
            raise _Damaged(f"kind is {row['kind']!r}, not one of {_EDIT_KINDS}")
        return ContextEdit(
            before=_stored_int(row["before"], "before"),
            removed=tuple(removed),
            replacement=None if replacement is None else _stored_int(replacement, "replacement"),
            kind=row["kind"],
        )
    except (_Damaged, ValueError) as err:  # ValueError: what ContextEdit itself refuses (nothing removed)
        raise StoreError(f"episode {episode_id} context edit {row['idx']} is damaged: {err}") from None


def _record_from_rows(
    episode: Mapping[str, Any], segment_rows: list[dict[str, Any]], edit_rows: list[dict[str, Any]]
) -> EpisodeRecord:
    episode_id = episode["id"]
    if [row["idx"] for row in segment_rows] != list(range(episode["num_segments"])):
        raise StoreError(
            f"episode {episode_id} is damaged: expected segments 0..{episode['num_segments'] - 1}, "
            f"found {[row['idx'] for row in segment_rows]}"
        )
    if [row["idx"] for row in edit_rows] != list(range(len(edit_rows))):
        raise StoreError(
            f"episode {episode_id} is damaged: expected context edits 0..{len(edit_rows) - 1}, "
            f"found {[row['idx'] for row in edit_rows]}"
        )
    try:
        info = _stored_json(episode["info"], "info")
    except _Damaged as err:
        raise StoreError(f"episode {episode_id} is damaged: {err}") from None
    trajectory = Trajectory(
        segments=[_segment_from_row(episode_id, row) for row in segment_rows],
        env_id=episode["env_id"],
        group_id=episode["group_id"],
        seed=episode["seed"],
        reward=episode["reward"],
        finish_reason=episode["finish_reason"],
        policy_version=episode["policy_version"],
        info=info,
        edits=[_edit_from_row(episode_id, row) for row in edit_rows],
    )
    if trajectory.num_tokens != episode["num_tokens"]:
        raise StoreError(
            f"episode {episode_id} is damaged: {trajectory.num_tokens} tokens in its segments, "
            f"{episode['num_tokens']} recorded"
        )
    if misfit := _edits_misfit(trajectory):
        raise StoreError(f"episode {episode_id} is damaged: {misfit}")
    return EpisodeRecord(
        id=episode_id, run_id=episode["run_id"], created_at=episode["created_at"], trajectory=trajectory
    )


def _run_from_row(row: Mapping[str, Any]) -> RunRecord:
    try:
        config = _stored_json(row["config"], "config")
    except _Damaged as err:
        raise StoreError(f"run {row['id']!r} is damaged: {err}") from None
    return RunRecord(**{**row, "config": config})


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def _new_run_id() -> str:
    # Sortable by time and readable in a terminal; the random tail keeps simultaneous runs apart.
    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def _where_sql(where: str | None, *conditions: str) -> str:
    """`` WHERE`` with the caller's condition (if any) and ours, all ANDed; "" when there is none."""
    # The newlines keep a trailing `-- comment` in the caller's condition from swallowing the closing parenthesis.
    parts = [*conditions, *([] if where is None else [f"(\n{where}\n)"])]
    return f" WHERE {' AND '.join(parts)}" if parts else ""


EPISODE_COLUMNS = frozenset(
    ("id", "run_id", "env_id", "group_id", "seed", "policy_version", "reward", "finish_reason", "num_tokens")
    + ("num_segments", "created_at")
)
_ORDER = re.compile(r"^\s*(\w+)(?:\s+(ASC|DESC))?\s*$", re.IGNORECASE)


def _order_sql(order_by: str) -> str:
    """``column [ASC|DESC]`` of the episodes table, checked (an order is never SQL pasted in as given)."""
    match = _ORDER.match(order_by) if isinstance(order_by, str) else None
    if match is None or match.group(1) not in EPISODE_COLUMNS:
        raise StoreError(
            f"order_by must be an episodes column with an optional ASC/DESC, got {order_by!r}; "
            f"columns: {', '.join(sorted(EPISODE_COLUMNS))}"
        )
    return f"{match.group(1)} {(match.group(2) or 'ASC').upper()}"


# An episode without a group id was played alone (a scripted demo, an eval): it is in no GRPO group.
_GROUPED, _UNGROUPED = "group_id != ''", "group_id = ''"


def _grouped_episodes(where: str | None, whole_groups: bool, alone: bool = False) -> str:
    """The ``FROM`` source of the grouped episodes that ``where`` selects: with ``whole_groups`` every member of a
    group with at least one matching member (aliased ``member``), otherwise only the matching episodes. ``alone``:
    the selected episodes without a group id too (each in a group of its own)."""
    grouped = () if alone else (_GROUPED,)
    if not whole_groups:
        return f"episodes{_where_sql(where, *grouped)}"
    # Unqualified names in the caller's condition resolve to the inner (unaliased) `episodes`. The unary + keeps
    # SQLite from looking each member's group up by its run (every episode of the run, for every member) rather than
    # by its group id: 12 s instead of 0.1 s on the demo's store.
    same_group = "+episodes.run_id IS member.run_id AND episodes.group_id = member.group_id"
    if alone:
        same_group += " AND (member.group_id != '' OR episodes.id = member.id)"
    matches = f"EXISTS (SELECT 1 FROM episodes{_where_sql(where, same_group)})"
    return f"episodes AS member{_where_sql(None, *grouped, matches)}"


_SUMMARY_COLUMNS = (
    "run_id",
    "group_id",
    "MIN(id) AS first_episode",
    "COUNT(*) AS members",
    "json_group_array(DISTINCT env_id) AS env_ids",
    "MIN(policy_version) AS min_version",
    "MAX(policy_version) AS max_version",
    "AVG(reward) AS reward_mean",
    "MIN(reward) AS reward_min",
    "MAX(reward) AS reward_max",
    "COUNT(reward) AS rewarded",
    "SUM(num_tokens) AS tokens",
    "MAX(num_tokens) AS max_tokens",
    "json_group_array(finish_reason) AS reasons",
)


def _summary_from_row(row: Mapping[str, Any]) -> GroupSummary:
    reasons = Counter(json.loads(row["reasons"]))
    env_ids = tuple(sorted(json.loads(row["env_ids"])))
    return GroupSummary(
        **{key: row[key] for key in row if key not in ("reasons", "env_ids")},
        env_ids=env_ids,
        finish_reasons=dict(reasons.most_common()),
    )


# ---------------------------------------------------------------------------------------------------------------
# Opening a file.


def _connect(path: Path, create: bool) -> sqlite3.Connection:
    if str(path) == ":memory:":
        return sqlite3.connect(":memory:", timeout=BUSY_TIMEOUT_S)
    if path.is_dir():
        raise StoreError(f"{path} is a directory, not a store file{_store_hint(path)}")
    if not create:
        if not path.is_file():
            raise StoreError(f"no store at {path}: the file does not exist")
        # mode=rw: never create a file as a side effect of reading one.
        return sqlite3.connect(f"{path.absolute().as_uri()}?mode=rw", uri=True, timeout=BUSY_TIMEOUT_S)
    path.parent.mkdir(parents=True, exist_ok=True)
    return sqlite3.connect(path, timeout=BUSY_TIMEOUT_S)


def _is_read_only_error(err: BaseException | None) -> bool:
    """Whether ``err`` is SQLite refusing to write a file this process may only read."""
    return isinstance(err, sqlite3.Error) and err.sqlite_errorcode & 0xFF == sqlite3.SQLITE_READONLY


def _store_hint(directory: Path) -> str:
    """Where the store of a run directory is, when ``directory`` holds one."""
    inside = directory / "trajectories.db"
    return f" (the run's store is {inside})" if inside.is_file() else ""


class Store:
    """A trajectory store in one SQLite file. Open with ``Store.open(path)``; use as a context manager."""

    def __init__(self, db: Database, path: Path) -> None:
        self._db = db
        self.path = path
        # False only while a store of version 1 is read as it is (see ``_upgrade``): no edits to read then.
        self._has_edits_table = True

    # -- lifecycle --------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str], create: bool = True) -> Store:
        """Open the store at ``path``; with ``create`` a missing or empty file becomes a new, empty store.

        Raises ``StoreError`` if the file is missing (and ``create`` is false), is not a SQLite database, is a SQLite
        database that is not a longstraw store, or was written by a newer schema version.
        """
        path = Path(path)
        try:
            conn = _connect(path, create)
        except sqlite3.Error as err:
            raise StoreError(f"cannot open store {path}: {err}") from err
        try:
            store = cls(Database(conn), path)
            store._prepare(create)
        except sqlite3.DatabaseError as err:
            conn.close()
            if err.sqlite_errorcode == sqlite3.SQLITE_NOTADB:
                raise StoreError(f"{path} is not a longstraw store: it is not a SQLite database") from err
            raise StoreError(f"cannot open store {path}: {err}") from err
        except BaseException:
            conn.close()
            raise
        return store

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({str(self.path)!r})"

    @property
    def schema_version(self) -> int:
        return self._pragma("user_version")

    def _pragma(self, name: str) -> Any:
        return self._db.execute(f"PRAGMA {name}").fetchone()[0]

    def _prepare(self, create: bool) -> None:
        self._db.execute("PRAGMA foreign_keys = ON")
        if self._is_empty():
            if not create:
                raise StoreError(f"{self.path} is not a longstraw store: it is an empty SQLite database")
            self._initialise()
        self._check_is_store()
        self._enable_wal()
        self._db.execute("PRAGMA synchronous = NORMAL")
        self._upgrade()

    def _enable_wal(self) -> None:
        # Switching a file to WAL needs an exclusive lock, and SQLite answers SQLITE_BUSY at once instead of waiting
        # out the busy timeout; processes that create the same store at the same moment retry here.
        if str(self.path) == ":memory:":
            return
        deadline = time.monotonic() + BUSY_TIMEOUT_S
        delay_s = 0.001
        while True:
            try:
                self._db.enable_wal()
            except sqlite3.OperationalError as err:
                if err.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                    raise
            if self._db.journal_mode == "wal":
                return
            time.sleep(delay_s)
            delay_s = min(2 * delay_s, 0.05)

    def _upgrade(self) -> None:
        """Bring a store of an older schema version to this one, in one transaction (so another process sees the
        old store or the new one, never a mix; several may open it at once). A store this process cannot write is
        left as it is and read as its version."""
        if self.schema_version >= SCHEMA_VERSION:
            return
        try:
            with self._write_transaction(f"upgrading the store schema to version {SCHEMA_VERSION}"):
                for version in range(self.schema_version + 1, SCHEMA_VERSION + 1):
                    self._run_script(_UPGRADES[version])
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except StoreError as err:
            if not _is_read_only_error(err.__cause__):
                raise
        self._has_edits_table = self.schema_version >= 2

    def _run_script(self, script: str) -> None:
        # One statement at a time, inside the caller's transaction (sqlite3's executescript would commit it).
        for statement in script.split(";"):
            if statement.strip():
                self._db.execute(statement)

    def _is_empty(self) -> bool:
        return self._pragma("application_id") == 0 and self._pragma("user_version") == 0 and not self._db.table_names()

    def _initialise(self) -> None:
        # WAL must be switched on outside a transaction; the schema is created under the write lock and only if no
        # other process created it while this one waited (several writers may open a fresh file at once).
        self._enable_wal()
        with self._write_transaction("creating the store schema"):
            if self._is_empty():
                self._run_script(_SCHEMA)
                self._db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
                self._db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    def _check_is_store(self) -> None:
        tables = self._db.table_names()
        if self._pragma("application_id") != APPLICATION_ID:
            listed = ", ".join(tables) if tables else "none"
            raise StoreError(f"{self.path} is not a longstraw store (it is a SQLite database with tables: {listed})")
        version = self.schema_version
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.path} has store schema version {version}, newer than this longstraw-agents reads "
                f"(up to {SCHEMA_VERSION}); upgrade longstraw-agents to open it"
            )
        missing = [name for name in TABLES if name not in tables and _ADDED_IN_VERSION.get(name, 1) <= version]
        if missing or version < 1:
            raise StoreError(f"{self.path} is a damaged longstraw store: missing tables {missing}, version {version}")

    @contextlib.contextmanager
    def _write_transaction(self, what: str) -> Iterator[None]:
        """All-or-nothing write; SQLite errors become ``StoreError`` saying that nothing was written."""
        try:
            # IMMEDIATE takes the write lock up front: a deferred transaction that reads first and writes later
            # fails with SQLITE_BUSY at once, without waiting, when another process committed in between.
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                self._db.rollback()
                raise
        except (sqlite3.Error, UnicodeEncodeError) as err:  # the latter: a lone surrogate in a run's strings
            raise StoreError(f"{what} in {self.path} failed, nothing was written: {err}") from err

    # -- writing ----------------------------------------------------------------------------------------------

    def add_run(
        self, run_id: str | None = None, *, config: Mapping[str, Any], model: str, tokenizer: str, notes: str = ""
    ) -> str:
        """Record a run (its config, model and tokenizer identity) and return its id (generated when None)."""
        run_id = _new_run_id() if run_id is None else run_id
        if not isinstance(run_id, str) or not run_id:
            raise StoreError(f"run id must be a non-empty str, got {run_id!r}")
        if not isinstance(config, Mapping):
            raise StoreError(f"run config must be a dict, got {type(config).__name__}")
        row = {
            "id": run_id,
            "created_at": _utc_now(),
            "config": _to_json(dict(config), what=f"run {run_id!r} config"),
            "model": str(model),
            "tokenizer": str(tokenizer),
            "notes": str(notes),
        }
        with self._write_transaction(f"adding run {run_id!r}"):
            if self._run_exists(run_id):
                raise StoreError(f"run {run_id!r} already exists in {self.path}")
            self._db.table("runs").insert(row)
        return run_id

    def add_episode(self, trajectory: Trajectory, run_id: str | None = None) -> int:
        """Write one trajectory (episode row and all its segments, in one transaction); return its episode id."""
        return self.add_episodes([trajectory], run_id=run_id)[0]

    def add_episodes(self, trajectories: Iterable[Trajectory], run_id: str | None = None) -> list[int]:
        """Write several trajectories in one transaction: all of them are stored, or (on error) none.

        Text, tool calls and info with lone surrogates are stored so that they read back exactly; in the id and
        reason strings they are escaped (``"\\ud800"`` → ``\\ud800``) and those fields listed in the stored
        ``info["store_escaped_surrogates"]`` (see the module docstring). The trajectories are left as they are."""
        # Encode before taking the write lock: bad input fails here with nothing written, and other writers wait
        # only for the inserts.
        encoded = [_encode(trajectory, run_id) for trajectory in trajectories]
        with self._write_transaction("writing episodes"):
            if run_id is not None and not self._run_exists(run_id):
                raise StoreError(f"unknown run {run_id!r} in {self.path}; record it with add_run() first")
            return [self._insert(episode) for episode in encoded]

    def _insert(self, encoded: _EncodedEpisode) -> int:
        episode_id = self._db.table("episodes").insert(encoded.episode).last_rowid
        assert episode_id is not None
        self._db.table("segments").insert_all({"episode_id": episode_id, **row} for row in encoded.segments)
        self._db.table("context_edits").insert_all({"episode_id": episode_id, **row} for row in encoded.edits)
        return episode_id

    def _run_exists(self, run_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM runs WHERE id = ?", [run_id]).fetchone() is not None

    # -- reading ----------------------------------------------------------------------------------------------

    def _select(self, sql: str, params: QueryParams = ()) -> list[dict[str, Any]]:
        try:
            return list(self._db.query(sql, params))
        except sqlite3.Error as err:
            raise StoreError(f"query on {self.path} failed: {err}\n  SQL: {sql}") from err

    def get_episode(self, episode_id: int) -> Trajectory:
        """The stored trajectory, token-exact (ids, masks, logprobs, text, tool calls and all metadata)."""
        return self.get_record(episode_id).trajectory

    def get_record(self, episode_id: int) -> EpisodeRecord:
        rows = self._select("SELECT * FROM episodes WHERE id = ?", [episode_id])
        if not rows:
            raise StoreError(f"no episode {episode_id} in {self.path}")
        return self._load(rows[0])

    def _load(self, episode: Mapping[str, Any]) -> EpisodeRecord:
        segments = self._select("SELECT * FROM segments WHERE episode_id = ? ORDER BY idx", [episode["id"]])
        return _record_from_rows(episode, segments, self._edit_rows(episode["id"]))

    def _edits_readable(self) -> bool:
        """Whether the store has the context_edits table: not when read as version 1, unless another process
        upgraded it since."""
        if not self._has_edits_table:
            self._has_edits_table = self.schema_version >= 2
        return self._has_edits_table

    def _edit_rows(self, episode_id: int) -> list[dict[str, Any]]:
        if not self._edits_readable():
            return []
        return self._select("SELECT * FROM context_edits WHERE episode_id = ? ORDER BY idx", [episode_id])

    def records(
        self,
        where: str | None = None,
        params: QueryParams = (),
        order_by: str = "id",
        limit: int | None = None,
    ) -> Iterator[EpisodeRecord]:
        """Stored episodes whose ``episodes`` row matches the SQL condition ``where`` (all when None).

        The condition is checked now (bad SQL raises ``StoreError`` with SQLite's message); segments are loaded
        lazily, one episode at a time, so a long replay never holds the whole store in memory.
        """
        if limit is not None and (not isinstance(limit, int) or limit < 0):
            raise StoreError(f"limit must be a non-negative int or None, got {limit!r}")
        limit_sql = "" if limit is None else f" LIMIT {limit}"
        sql = f"SELECT * FROM episodes{_where_sql(where)} ORDER BY {_order_sql(order_by)}{limit_sql}"
        return (self._load(row) for row in self._select(sql, params))

    def episodes(
        self,
        where: str | None = None,
        params: QueryParams = (),
        order_by: str = "id",
        limit: int | None = None,
    ) -> Iterator[Trajectory]:
        """Trajectories matching ``where``, e.g. ``store.episodes("reward > 0 AND policy_version >= ?", [3])``."""
        return (record.trajectory for record in self.records(where, params, order_by=order_by, limit=limit))

    def episode_ids(self, where: str | None = None, params: QueryParams = ()) -> list[int]:
        return [row["id"] for row in self._select(f"SELECT id FROM episodes{_where_sql(where)} ORDER BY id", params)]

    def count(self, where: str | None = None, params: QueryParams = ()) -> int:
        return self._select(f"SELECT COUNT(*) AS n FROM episodes{_where_sql(where)}", params)[0]["n"]

    def groups(self, where: str | None = None, params: QueryParams = ()) -> dict[str, list[Trajectory]]:
        """Episodes matching ``where`` grouped by ``group_id`` (groups in order of first episode, members by id).

        ``where`` selects episodes, not groups (``group_records`` can keep whole groups). Episodes with an empty
        group id belong to no group and are left out. A group id is only unique within a run: when the selection
        holds one group id in several runs this raises ``StoreError``; use ``group_records``, which keys groups
        by ``(run_id, group_id)``.
        """
        grouped: dict[str, list[Trajectory]] = {}
        for group in self.group_records(where, params, whole_groups=False):
            if group.group_id in grouped:
                raise StoreError(
                    f"group id {group.group_id!r} occurs in several runs of {self.path}; "
                    "use group_records() (groups by run and group id) or select one run_id"
                )
            grouped[group.group_id] = group.trajectories
        return grouped

    def group_records(
        self,
        where: str | None = None,
        params: QueryParams = (),
        *,
        whole_groups: bool = True,
    ) -> list[EpisodeGroup]:
        """GRPO groups: episodes grouped by ``(run_id, group_id)``, in order of their first episode.

        With ``whole_groups`` a group is kept whole when at least one of its members matches ``where``, so a
        condition such as ``reward > 0`` keeps the unsolved members that give the group its reward variance;
        otherwise only the matching members are kept. Episodes with an empty group id are in no group.
        """
        sql = f"SELECT * FROM {_grouped_episodes(where, whole_groups)} ORDER BY id"
        grouped: dict[tuple[str | None, str], list[EpisodeRecord]] = {}
        for row in self._select(sql, params):
            grouped.setdefault((row["run_id"], row["group_id"]), []).append(self._load(row))
        return [EpisodeGroup(run_id, group_id, tuple(records)) for (run_id, group_id), records in grouped.items()]

    def group_summaries(
        self, where: str | None = None, params: QueryParams = (), *, whole_groups: bool = True, alone: bool = False
    ) -> list[GroupSummary]:
        """The groups ``group_records`` would return, summarised by SQL without reading a segment (a store of many
        long episodes lists its groups at once), in order of their first episode. ``alone``: each selected episode
        without a group id is listed too, as a group of its own (its ``group_id`` is "")."""
        # an episode played alone is grouped by its own id
        key = "run_id, group_id, CASE WHEN group_id = '' THEN id END"
        sql = (
            f"SELECT {', '.join(_SUMMARY_COLUMNS)} FROM {_grouped_episodes(where, whole_groups, alone)} GROUP BY {key}"
        )
        return [_summary_from_row(row) for row in self._select(f"{sql} ORDER BY first_episode", params)]

    def ungrouped_count(self, where: str | None = None, params: QueryParams = ()) -> int:
        """How many episodes matching ``where`` have no group id (and so are in no group)."""
        sql = f"SELECT COUNT(*) AS n FROM episodes{_where_sql(where, _UNGROUPED)}"
        return self._select(sql, params)[0]["n"]

    def runs(self) -> list[RunRecord]:
        return [_run_from_row(row) for row in self._select("SELECT * FROM runs ORDER BY created_at, id")]

    def group_sizes(self, run_id: str, group_prefix: str) -> dict[str, int]:
        """Stored episodes per group id of ``run_id`` whose group id starts with ``group_prefix``."""
        rows = self._select(
            "SELECT group_id, COUNT(*) AS n FROM episodes WHERE run_id = ? AND substr(group_id, 1, ?) = ?"
            " GROUP BY group_id",
            [run_id, len(group_prefix), group_prefix],
        )
        return {row["group_id"]: row["n"] for row in rows}

    # -- aggregates (``longstraw_agents.report`` turns them into text) -----------------------------------------

    def totals(self, where: str | None = None, params: Sequence[Any] = ()) -> Totals:
        """Episode, group and token counts and the policy-version range of the episodes matching ``where``."""
        row = self._select(
            "SELECT COUNT(*) AS episodes, COUNT(DISTINCT group_id) AS groups, COALESCE(SUM(num_tokens), 0) AS tokens,"
            f" MIN(policy_version) AS min_version, MAX(policy_version) AS max_version FROM episodes{_where_sql(where)}",
            params,
        )[0]
        return Totals(**row)

    def env_totals(self, where: str | None = None, params: Sequence[Any] = ()) -> list[EnvTotals]:
        """Per environment id: episodes, groups, tokens and reward statistics of the episodes matching ``where``."""
        rows = self._select(
            "SELECT env_id, COUNT(*) AS episodes, COUNT(DISTINCT group_id) AS groups, SUM(num_tokens) AS tokens,"
            " AVG(reward) AS reward_mean, MIN(reward) AS reward_min, MAX(reward) AS reward_max"
            f" FROM episodes{_where_sql(where)} GROUP BY env_id ORDER BY env_id",
            params,
        )
        return [EnvTotals(**row) for row in rows]

    def edit_totals(self, where: str | None = None, params: Sequence[Any] = ()) -> tuple[int, int]:
        """How many of the episodes matching ``where`` edited their context, and their edits in all."""
        if not self._edits_readable():  # a store read as version 1: none of its episodes edited anything
            return 0, 0
        row = self._select(
            "SELECT COUNT(DISTINCT episode_id) AS edited, COUNT(*) AS edits FROM context_edits"
            f" WHERE episode_id IN (SELECT id FROM episodes{_where_sql(where)})",
            params,
        )[0]
        return int(row["edited"]), int(row["edits"])

    def finish_reasons(self, where: str | None = None, params: Sequence[Any] = ()) -> dict[str, int]:
        """How many episodes matching ``where`` ended for each reason, most frequent first."""
        rows = self._select(
            f"SELECT finish_reason, COUNT(*) AS n FROM episodes{_where_sql(where)} GROUP BY finish_reason"
            " ORDER BY n DESC, finish_reason",
            params,
        )
        return {row["finish_reason"]: row["n"] for row in rows}

    def episodes_per_run(self) -> Counter[str | None]:
        rows = self._select("SELECT run_id, COUNT(*) AS n FROM episodes GROUP BY run_id")
        return Counter({row["run_id"]: row["n"] for row in rows})
