"""The store's file: its tables and their versions, opening it, upgrading an older one in place, and the write
transaction every write runs in.

The schema version lives in ``PRAGMA user_version`` and the file is marked with ``PRAGMA application_id``; a store
written by a newer version of this package is refused rather than misread. A store of an older version is upgraded
in place when opened (its new tables and version in one transaction; versions of this package that predate it then
refuse it). A store this process cannot write (a read-only file) is read as it is: version 1 holds no edits.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from longstraw_agents.store.records import StoreError

SCHEMA_VERSION = 3
# "LSTR" in the SQLite header: marks the file as a longstraw store for `file(1)` and for `Store.open`.
APPLICATION_ID = int.from_bytes(b"LSTR", "big")
# Writers wait this long for the write lock before giving up; a commit takes milliseconds, so only a stuck
# process holding a transaction open would exhaust it.
BUSY_TIMEOUT_S = 60.0
TABLES = ("runs", "episodes", "segments", "context_edits")
ADDED_IN_VERSION = {"context_edits": 2}
"""The tables a store of an earlier version lacks (the others are in every version), by the version that added them."""
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
SCHEMA = _VERSION_1_SCHEMA + _CONTEXT_EDITS_SCHEMA + _TURN_VERSIONS_SCHEMA
UPGRADES = {2: _CONTEXT_EDITS_SCHEMA, 3: _TURN_VERSIONS_SCHEMA}
"""The statements that turn a store of version ``v - 1`` into one of version ``v`` (a new store runs ``SCHEMA``:
version 1's tables and every upgrade's)."""


def connect(path: Path, create: bool) -> sqlite3.Connection:
    """A connection to the file at ``path`` (``:memory:`` for none): with ``create`` a missing file and its folders
    are made; without, a missing file is a ``StoreError`` and the file is opened read-write, never created."""
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


def prepare(db: Database, path: Path, create: bool) -> None:
    """Make ``db`` (the file at ``path``) a store this package reads: a new one where the file is empty (with
    ``create``), checked to be a longstraw store of a version not newer than this one, in WAL mode, and upgraded to
    this version where this process may write it. ``StoreError`` says what the file is instead."""
    db.execute("PRAGMA foreign_keys = ON")
    if _is_empty(db):
        if not create:
            raise StoreError(f"{path} is not a longstraw store: it is an empty SQLite database")
        _initialise(db, path)
    _check_is_store(db, path)
    _enable_wal(db, path)
    db.execute("PRAGMA synchronous = NORMAL")
    _upgrade(db, path)


def schema_version(db: Database) -> int:
    return pragma(db, "user_version")


def pragma(db: Database, name: str) -> Any:
    return db.execute(f"PRAGMA {name}").fetchone()[0]


@contextlib.contextmanager
def write_transaction(db: Database, path: Path, what: str) -> Iterator[None]:
    """All-or-nothing write; SQLite errors become ``StoreError`` saying that nothing was written."""
    try:
        # IMMEDIATE takes the write lock up front: a deferred transaction that reads first and writes later
        # fails with SQLITE_BUSY at once, without waiting, when another process committed in between.
        db.execute("BEGIN IMMEDIATE")
        try:
            yield
            db.execute("COMMIT")
        except BaseException:
            db.rollback()
            raise
    except (sqlite3.Error, UnicodeEncodeError) as err:  # the latter: a lone surrogate in a run's strings
        raise StoreError(f"{what} in {path} failed, nothing was written: {err}") from err


def _enable_wal(db: Database, path: Path) -> None:
    # Switching a file to WAL needs an exclusive lock, and SQLite answers SQLITE_BUSY at once instead of waiting
    # out the busy timeout; processes that create the same store at the same moment retry here.
    if str(path) == ":memory:":
        return
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    delay_s = 0.001
    while True:
        try:
            db.enable_wal()
        except sqlite3.OperationalError as err:
            if err.sqlite_errorcode & 0xFF != sqlite3.SQLITE_BUSY or time.monotonic() > deadline:
                raise
        if db.journal_mode == "wal":
            return
        time.sleep(delay_s)
        delay_s = min(2 * delay_s, 0.05)


def _upgrade(db: Database, path: Path) -> None:
    """Bring a store of an older schema version to this one, in one transaction (so another process sees the
    old store or the new one, never a mix; several may open it at once). A store this process cannot write is
    left as it is and read as its version."""
    if schema_version(db) >= SCHEMA_VERSION:
        return
    try:
        with write_transaction(db, path, f"upgrading the store schema to version {SCHEMA_VERSION}"):
            for version in range(schema_version(db) + 1, SCHEMA_VERSION + 1):
                _run_script(db, UPGRADES[version])
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except StoreError as err:
        if not _is_read_only_error(err.__cause__):
            raise


def _run_script(db: Database, script: str) -> None:
    # One statement at a time, inside the caller's transaction (sqlite3's executescript would commit it).
    for statement in script.split(";"):
        if statement.strip():
            db.execute(statement)


def _is_empty(db: Database) -> bool:
    return pragma(db, "application_id") == 0 and pragma(db, "user_version") == 0 and not db.table_names()


def _initialise(db: Database, path: Path) -> None:
    # WAL must be switched on outside a transaction; the schema is created under the write lock and only if no
    # other process created it while this one waited (several writers may open a fresh file at once).
    _enable_wal(db, path)
    with write_transaction(db, path, "creating the store schema"):
        if _is_empty(db):
            _run_script(db, SCHEMA)
            db.execute(f"PRAGMA application_id = {APPLICATION_ID}")
            db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _check_is_store(db: Database, path: Path) -> None:
    tables = db.table_names()
    if pragma(db, "application_id") != APPLICATION_ID:
        listed = ", ".join(tables) if tables else "none"
        raise StoreError(f"{path} is not a longstraw store (it is a SQLite database with tables: {listed})")
    version = schema_version(db)
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{path} has store schema version {version}, newer than this longstraw-agents reads "
            f"(up to {SCHEMA_VERSION}); upgrade longstraw-agents to open it"
        )
    missing = [name for name in TABLES if name not in tables and ADDED_IN_VERSION.get(name, 1) <= version]
    if missing or version < 1:
        raise StoreError(f"{path} is a damaged longstraw store: missing tables {missing}, version {version}")
