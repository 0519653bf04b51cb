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

Any trajectory an environment produced is accepted, token ids never touched and the caller's trajectory not modified;
reading is checked row by row (``codec``). The file's schema version is checked and an older store upgraded in place
(``schema``); every write is one transaction, readers never block writers (``queries``: ``Store``).

One concern a module: ``records`` (what reads return, ``StoreError``), ``schema`` (tables, versions, opening and
upgrading a file, the write transaction), ``codec`` (rows to and from trajectories), ``queries`` (``Store``).
"""

from longstraw_agents.store.codec import ESCAPED_SURROGATES
from longstraw_agents.store.queries import EPISODE_COLUMNS, Store
from longstraw_agents.store.records import (
    TRAIN_VERSION,
    EnvTotals,
    EpisodeGroup,
    EpisodeRecord,
    GroupSummary,
    QueryParams,
    RunRecord,
    StoreError,
    Totals,
)
from longstraw_agents.store.schema import APPLICATION_ID, BUSY_TIMEOUT_S, SCHEMA_VERSION, TABLES

__all__ = [
    "APPLICATION_ID",
    "BUSY_TIMEOUT_S",
    "EPISODE_COLUMNS",
    "ESCAPED_SURROGATES",
    "SCHEMA_VERSION",
    "TABLES",
    "TRAIN_VERSION",
    "EnvTotals",
    "EpisodeGroup",
    "EpisodeRecord",
    "GroupSummary",
    "QueryParams",
    "RunRecord",
    "Store",
    "StoreError",
    "Totals",
]
