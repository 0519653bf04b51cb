"""Trajectories for store and report tests, each determined by an integer alone (a writer process in
test_store rebuilds exactly what it should have stored)."""

from __future__ import annotations

import numpy as np

from longstraw_agents.trajectory import ROLES, Role, Segment, Trajectory

LARGEST_ID = 2**31 - 1
TEXTS = ("", "plain words", "héllo wörld ✓ 🦙", "line\nbreak\ttab", "nul\x00byte", "中文字符 and émoji 🎉")
FINISH_REASONS = ("answered", "max_turns", "max_tokens", "error")


def make_segment(rng: np.random.Generator, idx: int, max_tokens: int) -> Segment:
    length = 0 if rng.random() < 0.15 else int(rng.integers(1, max_tokens + 1))
    ids = rng.integers(0, 2**31, size=length)
    if length:
        ids[0], ids[-1] = LARGEST_ID, 0
    logprobs = None
    if rng.random() < 0.6:
        logprobs = -rng.exponential(size=length).astype(np.float32)
        logprobs[rng.random(length) < 0.2] = np.nan
        logprobs[rng.random(length) < 0.05] = -np.inf
    tool_calls = [None, [], [{"name": "calculator", "arguments": {"expression": f"{idx} * 7"}, "id": f"c{idx}"}]]
    return Segment(
        role=ROLES[int(rng.integers(len(ROLES)))],
        token_ids=ids,
        loss_mask=(rng.random(length) < 0.5) if rng.random() < 0.5 else None,
        logprobs=logprobs,
        turn=idx // 2,
        text=TEXTS[int(rng.integers(len(TEXTS)))] + f" #{idx}",
        tool_calls=tool_calls[int(rng.integers(3))],
    )


def make_trajectory(n: int, *, num_segments: int | None = None, max_tokens: int = 64) -> Trajectory:
    """A trajectory determined by ``n`` alone, so another process can rebuild exactly what it should have stored."""
    rng = np.random.default_rng(n)
    count = int(rng.integers(1, 9)) if num_segments is None else num_segments
    return Trajectory(
        segments=[make_segment(rng, idx, max_tokens) for idx in range(count)],
        env_id=f"LongStraw/Env{n % 3}-v0",
        group_id=f"group-{n // 4}",
        seed=None if n % 5 == 0 else n * 1_000_003,
        reward=None if n % 7 == 0 else float(rng.normal()),
        finish_reason=FINISH_REASONS[n % len(FINISH_REASONS)],
        policy_version=n % 5,
        info={"n": n, "nested": {"values": [1, 2.5, None, True, "ü"]}, "empty": {}},
    )


def edge_case_trajectory() -> Trajectory:
    return Trajectory(
        segments=[
            Segment("system", np.array([0, 1, LARGEST_ID], dtype=np.int64), text="sÿstem 🦙"),
            Segment("user", [], text=""),
            Segment("assistant", [LARGEST_ID, 5], logprobs=[np.nan, -np.inf], loss_mask=[True, False], turn=3),
            Segment("tool", [7], tool_calls=[]),
            Segment("assistant", [], logprobs=[], tool_calls=[{"name": "x", "arguments": {}}]),
        ],
        env_id="LongStraw/Edge-v0",
        group_id="edge",
        seed=2**63 - 1,
        reward=1.0,
        finish_reason="context_limit",
        policy_version=2**40,
        info={"unicode": "ümlaut ✓", "list": [1, [2, [3]]], "float": 0.1},
    )


def edited_trajectory(n: int = 0) -> Trajectory:
    """An episode that edited its context three times (a trajectory determined by ``n`` alone):

    - evict: the first tool output (segment 3) leaves, a placeholder the environment writes (6) takes its place;
    - summary by the policy: its summary turn (7) replaces the turns so far (2, 6, 4, 5 and itself), reused verbatim;
    - summary by the environment: a summary it writes (11) replaces the next turn (8, 9, 10).

    Its four physical sequences are [0..4], [0, 1, 2, 6, 4, 5, 7], [0, 1, 7, 8, 9] and [0, 1, 7, 11, 12] (one an edit
    closed ends with its last assistant turn).
    """
    rng = np.random.default_rng(1000 + n)

    def segment(role: Role, length: int, turn: int, text: str) -> Segment:
        ids = rng.integers(0, 50_000, size=length)
        logprobs = -rng.exponential(size=length).astype(np.float32) if role == "assistant" else None
        return Segment(role, ids, logprobs=logprobs, turn=turn, text=text)

    trajectory = Trajectory(
        segments=[
            segment("system", 12, 0, "Answer the question; tools may help."),
            segment("user", 9, 0, "Where is the needle?"),
            segment("assistant", 7, 0, "search(haystack)"),
            segment("tool", 300, 0, "a long search result"),
            segment("assistant", 6, 1, "read(page 2)"),
            segment("tool", 40, 1, "page 2"),
        ],
        env_id="LongStraw/NeedleSearch-v0",
        group_id=f"edited-{n}",
        seed=n,
        reward=1.0,
        finish_reason="answered",
        policy_version=3,
        info={"edits": "evict, policy summary, env summary"},
    )
    trajectory.evict([3], segment("tool", 4, 1, "[search result evicted]"))
    trajectory.append(segment("assistant", 10, 2, "Summary: the needle is on page 2."))
    trajectory.summarize([2, 6, 4, 5, 7], 7)
    trajectory.extend([segment("user", 5, 3, "Go on."), segment("assistant", 8, 3, "read(page 3)")])
    trajectory.append(segment("tool", 30, 3, "page 3"))
    trajectory.summarize([8, 9, 10], segment("user", 6, 3, "Summary: page 3 has nothing."))
    trajectory.append(segment("assistant", 5, 4, "<answer>page 2</answer>"))
    return trajectory
