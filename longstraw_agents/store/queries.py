"""``Store``: writing runs and episodes, and reading them back by SQL over the ``episodes`` table — records,
whole GRPO groups, summaries and aggregates.

Concurrency and durability: the file is in WAL mode, so readers never block writers. Every write runs in one
``BEGIN IMMEDIATE`` transaction: an episode, all its segments and edits become visible together or not at all, even when
the writer is killed with SIGKILL, and concurrent writers queue on the busy timeout instead of failing.
``synchronous=NORMAL`` is the WAL setting SQLite recommends: a committed episode survives a crash of the process;
only a power loss can drop the last few commits, and it never corrupts the file. A ``Store`` object belongs to
one thread; open one per process (or thread) that writes.
"""

from __future__ import annotations

import os
import re
import secrets
import sqlite3
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from longstraw_agents.store import schema
from longstraw_agents.store.codec import (
    EncodedEpisode,
    encode,
    record_from_rows,
    run_from_row,
    summary_from_row,
    to_json,
    utc_now,
)
from longstraw_agents.store.records import (
    EnvTotals,
    EpisodeGroup,
    EpisodeRecord,
    GroupSummary,
    QueryParams,
    RunRecord,
    StoreError,
    Totals,
)
from longstraw_agents.trajectory import Trajectory


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


class Store:
    """A trajectory store in one SQLite file. Open with ``Store.open(path)``; use as a context manager."""

    def __init__(self, db: Database, path: Path) -> None:
        self._db = db
        self.path = path
        # False only while a store of version 1 is read as it is (``schema.prepare`` leaves a store this process
        # cannot write at its version): no edits to read then.
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
            conn = schema.connect(path, create)
        except sqlite3.Error as err:
            raise StoreError(f"cannot open store {path}: {err}") from err
        try:
            store = cls(Database(conn), path)
            schema.prepare(store._db, path, create)
            store._has_edits_table = store.schema_version >= 2
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
        return schema.schema_version(self._db)

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
            "created_at": utc_now(),
            "config": to_json(dict(config), what=f"run {run_id!r} config"),
            "model": str(model),
            "tokenizer": str(tokenizer),
            "notes": str(notes),
        }
        with schema.write_transaction(self._db, self.path, f"adding run {run_id!r}"):
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
        encoded = [encode(trajectory, run_id) for trajectory in trajectories]
        with schema.write_transaction(self._db, self.path, "writing episodes"):
            if run_id is not None and not self._run_exists(run_id):
                raise StoreError(f"unknown run {run_id!r} in {self.path}; record it with add_run() first")
            return [self._insert(episode) for episode in encoded]

    def _insert(self, encoded: EncodedEpisode) -> int:
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
        return record_from_rows(episode, segments, self._edit_rows(episode["id"]))

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
        return [summary_from_row(row) for row in self._select(f"{sql} ORDER BY first_episode", params)]

    def ungrouped_count(self, where: str | None = None, params: QueryParams = ()) -> int:
        """How many episodes matching ``where`` have no group id (and so are in no group)."""
        sql = f"SELECT COUNT(*) AS n FROM episodes{_where_sql(where, _UNGROUPED)}"
        return self._select(sql, params)[0]["n"]

    def runs(self) -> list[RunRecord]:
        return [run_from_row(row) for row in self._select("SELECT * FROM runs ORDER BY created_at, id")]

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
