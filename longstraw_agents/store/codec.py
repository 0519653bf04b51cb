"""Rows of the store's tables to and from trajectories: token ids, loss masks and logprobs as fixed little-endian
blobs, metadata as strict JSON, lone surrogates kept or escaped, and every stored value checked on reading.

A policy can write a lone UTF-16 surrogate (``"\\ud800"`` in tool-call JSON, decoded by the tool parser into a
one-character string that UTF-8, and so SQLite's TEXT, cannot hold). A segment's text holding one is stored as its
``surrogatepass`` UTF-8 bytes (a blob in the ``text`` column, decoded the same way on reading); tool calls and
``info`` holding one are stored as ASCII JSON, whose ``\\ud800`` escapes ``json.loads`` restores. Only the id and
reason strings of an episode (``env_id``, ``group_id``, ``finish_reason``: SQL keys, compared as text) are
*escaped*: a lone surrogate becomes the six characters ``\\ud800`` (Python's ``backslashreplace``), and
``info["store_escaped_surrogates"]`` lists the fields that were altered.

A damaged row (a blob of the wrong length or type, negative ids, a loss mask other than 0/1, an unknown role, broken
tool-call JSON, a context edit that does not fit the episode's segments...) raises ``StoreError`` naming its episode
and row.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, get_args

import numpy as np

from longstraw_agents.store.records import EpisodeRecord, GroupSummary, RunRecord, StoreError
from longstraw_agents.trajectory import ROLES, ContextEdit, EditKind, Segment, Trajectory

_INT64 = np.iinfo(np.int64)
ESCAPED_SURROGATES = "store_escaped_surrogates"
"""The ``info`` key listing the id / reason fields whose lone surrogates ``add_episodes`` escaped (absent when none
were)."""
_SURROGATE = re.compile("[\ud800-\udfff]")


# -- encoding: numpy arrays <-> fixed little-endian blobs, metadata <-> strict JSON --------------------------------


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


def to_json(value: Any, *, what: str) -> str:
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
        "info": to_json(info, what="trajectory.info"),
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
        "tool_calls": None if calls is None else to_json(calls, what=f"segment {idx}"),
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
class EncodedEpisode:
    """A trajectory as the rows it is written as: its ``episodes`` row, its ``segments`` and ``context_edits`` rows
    (without the episode id, known once the episode row is in)."""

    episode: dict[str, Any]
    segments: list[dict[str, Any]]
    edits: list[dict[str, Any]]


def encode(trajectory: Trajectory, run_id: str | None) -> EncodedEpisode:
    """``trajectory``'s rows, every value checked (``StoreError`` for one that cannot be stored)."""
    if not isinstance(trajectory, Trajectory):
        raise StoreError(f"expected a Trajectory, got {type(trajectory).__name__}")
    segments = [_segment_row(idx, seg) for idx, seg in enumerate(trajectory.segments)]
    edits = [_edit_row(idx, edit) for idx, edit in enumerate(trajectory.edits)]
    if misfit := _edits_misfit(trajectory):
        raise StoreError(f"cannot store the trajectory: {misfit}")
    return EncodedEpisode(episode=_episode_row(trajectory, run_id, utc_now()), segments=segments, edits=edits)


# -- decoding: rows -> trajectories, each value checked -----------------------------------------------------------


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


def record_from_rows(
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


def run_from_row(row: Mapping[str, Any]) -> RunRecord:
    try:
        config = _stored_json(row["config"], "config")
    except _Damaged as err:
        raise StoreError(f"run {row['id']!r} is damaged: {err}") from None
    return RunRecord(**{**row, "config": config})


def summary_from_row(row: Mapping[str, Any]) -> GroupSummary:
    reasons = Counter(json.loads(row["reasons"]))
    env_ids = tuple(sorted(json.loads(row["env_ids"])))
    return GroupSummary(
        **{key: row[key] for key in row if key not in ("reasons", "env_ids")},
        env_ids=env_ids,
        finish_reasons=dict(reasons.most_common()),
    )


def utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")
