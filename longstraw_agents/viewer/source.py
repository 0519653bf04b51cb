"""What the viewer reads: a store (a run directory's ``trajectories.db``, or any store file), the ``metrics.jsonl``
beside it, and a selection of its groups.

The index lists the runs and the selected groups from SQL summaries alone (no segment is read); a group is read
when it is shown. A group is named by the id of its first episode; an episode without a group id (a scripted demo's)
is listed as a group of its own. Training stores group ``K`` of step ``N`` as ``stepN-gK`` (``stepN-dpR-gK`` with
data parallelism), which links a group to the step of ``metrics.jsonl`` that trained on it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from longstraw_agents.store import GroupSummary, QueryParams, RunRecord, Store, StoreError
from longstraw_agents.viewer.group_view import GroupPage, LoadedGroup, ViewLimits, Window, group_page, token_window
from longstraw_agents.viewer.tokens import TokenText, token_text

STORE_FILE = "trajectories.db"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
_STEP_GROUP = re.compile(r"^step(\d+)-")
# a step line's figures the page draws or lists (lines written by older versions may lack some)
STEP_FIGURES = ("policy_version", "reward_mean", "reward_std", "loss", "kl", "grad_norm", "episode_tokens_mean")
LOADED_GROUPS = 4  # groups kept in memory by a server (a range request re-reads none of them)


def step_of_group(group_id: str) -> int | None:
    """The training step (from 1) whose rollout stored ``group_id`` (``stepN-...``), None for other ids."""
    match = _STEP_GROUP.match(group_id)
    return int(match.group(1)) if match else None


def scale_rewards(run: RunRecord | None) -> bool:
    """The run's ``trainer.loss.scale_rewards`` (the trainer's default, true, when its config does not say)."""
    loss = (run.config.get("trainer") or {}).get("loss") or {} if run is not None else {}
    return bool(loss.get("scale_rewards", True))


def tokenizer_spec(run: RunRecord | None) -> str | None:
    """What to load a run's tokenizer from: its config's ``tokenizer`` (a training run's), else its identity."""
    if run is None:
        return None
    spec = run.config.get("tokenizer")
    return spec if isinstance(spec, str) and spec else run.tokenizer or None


@dataclass(frozen=True)
class Metrics:
    """A run's ``metrics.jsonl``: its optimizer steps (``STEP_FIGURES``, by step) and held-out evaluations."""

    path: str
    run_id: str | None
    steps: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    skipped_lines: int


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def read_metrics(path: Path, run_id: str | None) -> Metrics:
    """Step and eval lines of ``path``; lines that are not JSON objects (a line being written) are counted, not
    read."""
    steps, evals, skipped = [], [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not _is_number(record.get("step")):
            skipped += not isinstance(record, dict)
            continue
        phase = record.get("phase", "grpo")  # the first versions wrote step lines without a phase
        if phase == "grpo":
            figures = {k: record[k] for k in STEP_FIGURES if _is_number(record.get(k))}
            steps.append({"step": record["step"], **figures})
        elif phase == "eval" and _is_number(record.get("reward_mean")):
            evals.append({"step": record["step"], "reward_mean": record["reward_mean"]})
    return Metrics(path=str(path), run_id=run_id, steps=steps, evals=evals, skipped_lines=skipped)


def _metrics_run(runs: Sequence[RunRecord], config_path: Path) -> str | None:
    """The run ``metrics.jsonl`` belongs to: the one whose config is the run directory's ``config.json``, else the
    store's last run (the one training appends to)."""
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text())
        except json.JSONDecodeError:
            config = None
        matching = [run.id for run in runs if run.config == config]
        if matching:
            return matching[-1]
    return runs[-1].id if runs else None


def resolve_store(path: str | Path) -> Path:
    """The store file of a run directory or a store path; ``StoreError`` when there is none."""
    path = Path(path)
    if path.is_dir():
        if not (path / STORE_FILE).is_file():
            raise StoreError(f"{path} is a directory without a store ({STORE_FILE}): give a run directory or a store")
        return path / STORE_FILE
    if not path.is_file():
        raise StoreError(f"no store at {path}: the file does not exist")
    return path


class ViewSource:
    """A store as the viewer shows it: the index of the selected groups, and each group on demand.

    ``where``/``params`` select episodes with SQL as ``Store.group_records`` does (a group with one matching
    member is kept whole); ``tokenizer`` overrides the runs' own. Safe to share between threads: every read opens
    the store anew, and loaded groups are kept under a lock.
    """

    def __init__(
        self,
        path: str | Path,
        where: str | None = None,
        params: QueryParams = (),
        *,
        tokenizer: str | None = None,
        limits: ViewLimits | None = None,
    ) -> None:
        self.db = resolve_store(path)
        self.where = where
        self.params = params
        self.tokenizer = tokenizer
        self.limits = limits or ViewLimits()
        self._texts: dict[str | None, TokenText] = {}
        self._loaded: OrderedDict[int, LoadedGroup] = OrderedDict()
        self._lock = threading.Lock()
        self.runs: dict[str, RunRecord] = {}
        self.summaries: list[GroupSummary] = []
        self.metrics: Metrics | None = None
        self.refresh()

    def refresh(self) -> None:
        """Read the runs, the selected groups' summaries and the metrics again (a run may still be writing)."""
        with self._store() as store:
            runs = {run.id: run for run in store.runs()}
            summaries = store.group_summaries(self.where, self.params, alone=True)
        metrics_path = self.db.parent / METRICS_FILE
        metrics = None
        if metrics_path.is_file():
            metrics = read_metrics(metrics_path, _metrics_run(list(runs.values()), self.db.parent / CONFIG_FILE))
        self.runs, self.summaries, self.metrics = runs, summaries, metrics

    def _store(self) -> Store:
        return Store.open(self.db, create=False)

    def _text(self, run_id: str | None) -> TokenText:
        spec = self.tokenizer or tokenizer_spec(self.runs.get(run_id) if run_id else None)
        with self._lock:
            if spec not in self._texts:
                self._texts[spec] = token_text(spec)
            return self._texts[spec]

    # -- the index --------------------------------------------------------------------------------------------

    def index(self) -> dict[str, Any]:
        """Runs, the selected groups and the metrics, as the page's JSON."""
        groups: Counter[str | None] = Counter(s.run_id for s in self.summaries if s.group_id)
        alone: Counter[str | None] = Counter(s.run_id for s in self.summaries if not s.group_id)
        runs = [
            {
                "id": run.id,
                "created_at": run.created_at,
                "model": run.model,
                "tokenizer": run.tokenizer,
                "notes": run.notes,
                "groups": groups[run.id],
                "alone": alone[run.id],
                "has_metrics": self.metrics is not None and self.metrics.run_id == run.id,
            }
            for run in self.runs.values()
        ]
        return {
            "store": str(self.db),
            "selection": self.where,
            "runs": runs,
            "groups": [self._group_entry(summary) for summary in self.summaries],
            "metrics": None if self.metrics is None else dataclasses.asdict(self.metrics),
        }

    @staticmethod
    def _group_entry(summary: GroupSummary) -> dict[str, Any]:
        entry = dataclasses.asdict(summary)
        entry["key"] = entry.pop("first_episode")
        entry["step"] = step_of_group(summary.group_id)
        return entry

    # -- one group --------------------------------------------------------------------------------------------

    def load(self, key: int) -> LoadedGroup:
        """The group whose first episode is ``key`` (``KeyError`` when no group starts there)."""
        with self._lock:
            if key in self._loaded:
                self._loaded.move_to_end(key)
                return self._loaded[key]
        group = self._read(key)
        with self._lock:
            self._loaded[key] = group
            while len(self._loaded) > LOADED_GROUPS:
                self._loaded.popitem(last=False)
        return group

    def _read(self, key: int) -> LoadedGroup:
        with self._store() as store:
            try:
                first = store.get_record(key)
            except StoreError:
                raise KeyError(f"no episode {key} in {self.db}") from None
            records: tuple[Any, ...] = (first,)
            group_id = first.trajectory.group_id
            if group_id:
                [group] = store.group_records("run_id IS ? AND group_id = ?", [first.run_id, group_id])
                records = group.records
        if records[0].id != key:
            raise KeyError(f"episode {key} is not the first of its group {group_id!r} (episode {records[0].id} is)")
        return LoadedGroup(records, scale_rewards(self.runs.get(first.run_id) if first.run_id else None))

    def group(self, key: int) -> GroupPage:
        group = self.load(key)
        return group_page(group, self._text(group.records[0].run_id), self.limits)

    def window(self, key: int, member: int, start: int, end: int) -> Window:
        """Tokens ``[start, end)`` of one member (at most ``limits.range_tokens``); ``ValueError`` when out of
        range, ``KeyError`` when there is no such group."""
        group = self.load(key)
        text = self._text(group.records[0].run_id)
        return token_window(group, member, start, end, text, self.limits.range_tokens)
