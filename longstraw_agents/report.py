"""``longstraw inspect``: a trajectory store as text for people — an overview, then transcripts.

The store answers the queries (``Store.totals``, ``env_totals``, ``finish_reasons``, ``records``...); this module only
lays their answers out: aligned tables, one line per segment with its role, turn, token count, loss fraction, mean
behaviour logprob and text (cut to ``max_text`` characters with its head and tail kept), tool calls under their turn;
for an episode whose turns record the policy version that sampled them, that version and the turn's staleness
(versions between it and the one that trained on the episode, ``info["train_version"]``).
An episode that edited its context lists its physical sequences and one line per edit: where in the log it happened,
what left the context and what took its place.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from longstraw_agents.store import TRAIN_VERSION, EpisodeRecord, RunRecord, Store, StoreError
from longstraw_agents.trajectory import ContextEdit, EditKind, Segment, Trajectory


def summary_text(
    store: Store,
    episode: int | None = None,
    group: str | None = None,
    transcript: bool = False,
    where: str | None = None,
    params: Sequence[Any] = (),
    max_text: int = 120,
) -> str:
    """The overview of the episodes matching ``where`` (all by default), then transcripts.

    ``episode`` or ``group`` shows that episode's (or each group member's) transcript; ``transcript`` adds the
    transcripts of every matching episode to the overview. Segment text is cut to ``max_text`` characters
    (0: never cut).
    """
    if episode is not None and group is not None:
        raise StoreError("summary_text takes an episode or a group, not both")
    if episode is not None:
        return transcript_text(store.get_record(episode), max_text)
    if group is not None:
        return _group_text(store, group, max_text)
    sections = [_overview_text(store, where, params)]
    if transcript:
        sections.extend(transcript_text(record, max_text) for record in store.records(where, params))
    return "\n\n".join(sections)


def _group_text(store: Store, group: str, max_text: int) -> str:
    records = list(store.records("group_id = ?", [group]))
    if not records:
        raise StoreError(f"no group {group!r} in {store.path}")
    rewards = [r.trajectory.reward for r in records if r.trajectory.reward is not None]
    header = f"group {group}: {len(records)} episodes, reward {_stats(rewards)}"
    return "\n\n".join([header, *(transcript_text(record, max_text) for record in records)])


def _overview_text(store: Store, where: str | None, params: Sequence[Any]) -> str:
    totals = store.totals(where, params)
    scope = "" if where is None else f"  (where {where})"
    counts = f"episodes {totals.episodes:,}  groups {totals.groups:,}  tokens {totals.tokens:,}"
    if totals.episodes:
        counts += f"  policy versions {totals.min_version}..{totals.max_version}"
    runs = store.runs()
    lines = [f"store {store.path} (schema v{store.schema_version})", f"runs {len(runs)}", counts + scope]
    if not totals.episodes:
        return "\n".join(lines)
    reasons = store.finish_reasons(where, params)
    lines.extend(["", *_env_table(store, where, params), ""])
    lines.append("finish reasons  " + ", ".join(f"{reason} {n:,}" for reason, n in reasons.items()))
    edited, edits = store.edit_totals(where, params)
    if edited:
        lines.append(f"context edits  {edits:,} in {_count(edited, 'episode')}")
    if runs:
        lines.extend(["", *_runs_table(store, runs)])
    return "\n".join(lines)


def _env_table(store: Store, where: str | None, params: Sequence[Any]) -> list[str]:
    return _table(
        ["env", "episodes", "groups", "tokens", "reward mean", "min", "max"],
        [
            [env.env_id or "(none)", f"{env.episodes:,}", f"{env.groups:,}", f"{env.tokens:,}"]
            + [_num(stat) for stat in (env.reward_mean, env.reward_min, env.reward_max)]
            for env in store.env_totals(where, params)
        ],
        align="lrrrrr",
    )


def _runs_table(store: Store, runs: list[RunRecord]) -> list[str]:
    per_run = store.episodes_per_run()
    lines = ["runs"]
    for run in runs:
        lines.append(
            f"  {run.id}  model {run.model}  tokenizer {run.tokenizer}  episodes {per_run[run.id]:,}"
            f"  created {run.created_at}" + (f"  notes: {run.notes}" if run.notes else "")
        )
    return lines


def transcript_text(record: EpisodeRecord, max_text: int = 120) -> str:
    """One episode: a header line (ids, reward, finish reason, sizes), its info, then one row per segment."""
    t = record.trajectory
    header = (
        f"episode {record.id}  env {t.env_id or '(none)'}  group {t.group_id or '(none)'}  seed {t.seed}"
        f"  policy v{t.policy_version}  reward {_num(t.reward)}  {t.finish_reason}"
        f"  {t.num_tokens:,} tokens in {len(t.segments)} segments  run {record.run_id or '-'}"
    )
    lines = [header]
    if t.info:
        lines.append(f"  info {_preview(_json(t.info), max_text, quote=False)}")
    rows = []
    versioned = any(seg.policy_version is not None for seg in t.segments)
    for idx, seg in enumerate(t.segments):
        cells = [str(idx), seg.role, str(seg.turn), f"{len(seg):,}", _loss_fraction(seg), _mean_logprob(seg)]
        if versioned:
            cells[3:3] = _version_cells(seg, t.info.get(TRAIN_VERSION))
        rows.append([*cells, _preview(seg.text, max_text)])
        if seg.tool_calls is not None:
            rows.append([""] * len(cells) + [f"tool_calls {_preview(_json(seg.tool_calls), max_text, quote=False)}"])
    columns = ["#", "role", "turn", "tokens", "loss", "logp", "text"]
    if versioned:
        columns[3:3] = ["version", "stale"]
    align = "rlr" + "rr" * versioned + "rrr"
    lines.extend(_table(columns, rows, align=align, indent="  "))
    if t.is_edited:
        lines.extend(_edits_lines(t))
    return "\n".join(lines)


def _version_cells(segment: Segment, trained_at: Any) -> list[str]:
    """The version of the weights that sampled the segment, and how many versions older it was than those that
    trained on it (asynchronous GRPO: a turn's staleness); "-" where unknown."""
    version = segment.policy_version
    if version is None:
        return ["-", "-"]
    stale = str(trained_at - version) if isinstance(trained_at, int) else "-"
    return [str(version), stale]


def _edits_lines(trajectory: Trajectory) -> list[str]:
    """The physical sequences (what the trainer trains as members) and one line per context edit."""
    sequences = trajectory.physical_sequences()
    sizes = [trajectory.num_tokens_of(seq.segments) for seq in sequences]
    loss = [sum(int(trajectory.segments[k].loss_mask.sum()) for k in seq.own()) for seq in sequences]
    lines = [
        f"  {_count(len(trajectory.edits), 'context edit')}, {_count(len(sequences), 'physical sequence')}:"
        f" {', '.join(f'{n:,}' for n in sizes)} tokens (loss {', '.join(f'{n:,}' for n in loss)})"
    ]
    lines.extend(f"  edit {k} {_edit_text(trajectory, edit)}" for k, edit in enumerate(trajectory.edits, start=1))
    return lines


_EDIT_WORDS: dict[EditKind, tuple[str, str]] = {"evict": ("evict", "placeholder"), "summary": ("summarize", "summary")}
"""Per kind of edit: what it does to the segments it removes, and what the segment in their place is."""


def _edit_text(trajectory: Trajectory, edit: ContextEdit) -> str:
    """Where and what, e.g. ``before segment 9 (turn 4): evict segments 3 (tool, 1,204 tokens) -> placeholder segment 9
    (12 tokens)``."""
    segments = trajectory.segments
    where = (
        f"before segment {edit.before} (turn {segments[edit.before].turn})"
        if edit.before < len(segments)
        else f"at the end of the log (after segment {edit.before - 1})"
    )
    verb, name = _EDIT_WORDS[edit.kind]
    removed = [segments[k] for k in edit.removed]
    tokens = sum(len(seg) for seg in removed)
    gone = f"{verb} segments {_indices(edit.removed)} ({_roles(removed)}, {tokens:,} tokens)"
    if edit.replacement is None:
        return f"{where}: {gone} -> nothing"
    reused = "reused, " if edit.replacement < edit.before else ""
    size = len(segments[edit.replacement])
    return f"{where}: {gone} -> {name} segment {edit.replacement} ({reused}{size:,} tokens)"


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _indices(indices: Sequence[int]) -> str:
    """Log indices with runs of consecutive ones as ``first..last``: ``2, 6, 4..7``."""
    runs: list[list[int]] = []
    for k in indices:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}..{run[-1]}" for run in runs)


def _roles(segments: Sequence[Segment]) -> str:
    """``tool`` for one segment, ``2 assistant + 3 tool`` for several (in order of first appearance)."""
    if len(segments) == 1:
        return segments[0].role
    return " + ".join(f"{n} {role}" for role, n in Counter(seg.role for seg in segments).items())


def _json(value: Any) -> str:
    """Stored JSON is strict and plain already (the store checked it on the way in)."""
    return json.dumps(value, ensure_ascii=False)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _stats(values: list[float]) -> str:
    if not values:
        return "-"
    return f"mean {_num(sum(values) / len(values))} min {_num(min(values))} max {_num(max(values))}"


def _preview(text: str, max_chars: int, *, quote: bool = True) -> str:
    """Text on one line (quoted, escapes visible); long text keeps its head and tail and says how much was cut. A
    lone surrogate (stored exactly, but no terminal encoding can print it) is shown as its ``\\udXXX`` escape."""
    show = (lambda part: json.dumps(part, ensure_ascii=False)) if quote else (lambda part: part.replace("\n", " "))
    if not max_chars or len(text) <= max_chars:
        shown = show(text)
    else:
        head = text[: max_chars * 2 // 3]
        tail = text[len(text) - (max_chars - len(head)) :]
        shown = f"{show(head)} … {show(tail)} ({len(text):,} chars)"
    return shown.encode("utf-8", "backslashreplace").decode("utf-8")


def _table(header: list[str], rows: list[list[str]], align: str, indent: str = "") -> list[str]:
    """Columns two spaces apart, aligned per ``align`` ("l"/"r", one per column but the last, which is unpadded)."""
    widths = [max(len(cells[i]) for cells in [header, *rows]) for i in range(len(align))]

    def line(cells: list[str]) -> str:
        padded = [
            cell.ljust(width) if how == "l" else cell.rjust(width)
            for cell, width, how in zip(cells, widths, align, strict=False)
        ]
        return (indent + "  ".join([*padded, cells[-1]])).rstrip()

    return [line(header), *(line(cells) for cells in rows)]


def _loss_fraction(segment: Segment) -> str:
    return "-" if not len(segment) else f"{segment.loss_mask.mean():.0%}"


def _mean_logprob(segment: Segment) -> str:
    """Mean behaviour logprob over the tokens where it is known."""
    if segment.logprobs is None:
        return "-"
    known = segment.logprobs[~np.isnan(segment.logprobs)]
    return f"{known.mean():.3f}" if known.size else "nan"
