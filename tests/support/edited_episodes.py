"""A GRPO group of agent episodes that edit their context, with the physical sequences written out by hand.

Each episode is a script of appends and edits, played through ``Trajectory.evict`` / ``Trajectory.summarize``; its
``sequences`` are the token sequences the policy conditioned on, written independently of the code under test as
log indices in context order, a ``*`` on the segments generated under that sequence (the ones carrying its loss):

- e0 evicts its first tool output after two turns (a placeholder takes its place) and goes on for two more;
- e1 is e0 up to the eviction, then answers differently (its second sequence shares e0's up to the new turn);
- e2 asks for a summary and replaces its turns by the policy's summary, reused verbatim;
- e3 has its turns replaced by a summary the environment writes;
- e4 never edits (its one sequence extends the first sequence of e0, e1 and e3);
- e5 evicts one turn earlier, with another placeholder.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from longstraw_agents.trajectory import Role, Segment, Trajectory

VOCAB = 256
REWARDS = [1.0, 0.0, 0.5, 0.25, 0.75, 0.6]

# block -> (role, length); a block is one segment's tokens, the same tokens wherever the name recurs
BLOCKS: dict[str, tuple[Role, int]] = {
    "system": ("system", 12),
    "task": ("user", 14),
    "a1": ("assistant", 5),
    "tool1": ("tool", 20),
    "a2": ("assistant", 6),
    "tool2": ("tool", 9),
    "evicted": ("tool", 4),
    "a3": ("assistant", 5),
    "tool3": ("tool", 7),
    "a4": ("assistant", 4),
    "a3b": ("assistant", 6),
    "a4b": ("assistant", 3),
    "tool2b": ("tool", 8),
    "ask": ("user", 6),
    "summary": ("assistant", 7),
    "a5": ("assistant", 5),
    "tool5": ("tool", 6),
    "a6": ("assistant", 4),
    "written": ("user", 9),
    "a7": ("assistant", 5),
    "evicted2": ("tool", 3),
    "a2c": ("assistant", 6),
    "tool6": ("tool", 5),
    "a8": ("assistant", 4),
}

# a step: ("append", block) | ("evict", removed, placeholder block) | ("summarize", removed, block or log index)
Step = tuple
SCRIPTS: list[list[Step]] = [
    [("append", b) for b in ("system", "task", "a1", "tool1", "a2", "tool2")]
    + [("evict", [3], "evicted")]
    + [("append", b) for b in ("a3", "tool3", "a4")],
    [("append", b) for b in ("system", "task", "a1", "tool1", "a2", "tool2")]
    + [("evict", [3], "evicted")]
    + [("append", b) for b in ("a3b", "tool3", "a4b")],
    [("append", b) for b in ("system", "task", "a1", "tool1", "a2", "tool2b", "ask", "summary")]
    + [("summarize", [2, 3, 4, 5, 6, 7], 7)]
    + [("append", b) for b in ("a5", "tool5", "a6")],
    [("append", b) for b in ("system", "task", "a1", "tool1", "a2", "tool2")]
    + [("summarize", [2, 3, 4, 5], "written")]
    + [("append", "a7")],
    [("append", b) for b in ("system", "task", "a1", "tool1", "a2", "tool2", "a3")],
    [("append", b) for b in ("system", "task", "a1", "tool1")]
    + [("evict", [3], "evicted2")]
    + [("append", b) for b in ("a2c", "tool6", "a8")],
]

# per episode, its physical sequences: log indices in context order, "*" where generated under that sequence; one an
# edit closed ends with its last generated segment (the observation the edit answered was read in the next one)
SEQUENCES: list[list[str]] = [
    ["0 1 2* 3 4*", "0 1 2 6 4 5 7* 8 9*"],
    ["0 1 2* 3 4*", "0 1 2 6 4 5 7* 8 9*"],
    ["0 1 2* 3 4* 5 6 7*", "0 1 7 8* 9 10*"],
    ["0 1 2* 3 4*", "0 1 6 7*"],
    ["0 1 2* 3 4* 5 6*"],
    ["0 1 2*", "0 1 2 4 5* 6 7*"],
]


def block_tokens(seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens per block; first tokens differ between blocks so that divergences are visible."""
    rng = np.random.default_rng(seed)
    firsts = rng.permutation(VOCAB)[: len(BLOCKS)]
    out = {}
    for first, (name, (_, length)) in zip(firsts, BLOCKS.items(), strict=True):
        tokens = rng.integers(0, VOCAB, length)
        tokens[0] = first
        out[name] = tokens
    return out


def script_log(script: list[Step]) -> list[str]:
    """The block of each log segment, in writing order."""
    log: list[str] = []
    for step in script:
        if step[0] == "append":
            log.append(step[1])
        elif isinstance(step[2], str):
            log.append(step[2])
    return log


def play(
    script: list[Step],
    tokens: Mapping[str, np.ndarray],
    logprobs: Callable[[int], np.ndarray | None] = lambda index: None,
) -> Trajectory:
    """The trajectory of ``script``; ``logprobs(log index)``: behaviour log-probs of an assistant segment."""
    trajectory = Trajectory()

    def segment(block: str) -> Segment:
        role = BLOCKS[block][0]
        behaviour = logprobs(len(trajectory.segments)) if role == "assistant" else None
        return Segment(role, tokens[block], logprobs=behaviour, text=block)

    for step in script:
        if step[0] == "append":
            trajectory.append(segment(step[1]))
        elif step[0] == "evict":
            trajectory.evict(step[1], segment(step[2]))
        else:
            replacement = step[2] if isinstance(step[2], int) else segment(step[2])
            trajectory.summarize(step[1], replacement)
    return trajectory


@dataclass(frozen=True)
class ExpectedSequence:
    """One hand-written physical sequence: its log indices and which of them were generated under it."""

    segments: tuple[int, ...]
    generated: frozenset[int]

    @classmethod
    def parse(cls, spec: str) -> ExpectedSequence:
        items = spec.split()
        return cls(tuple(int(i.rstrip("*")) for i in items), frozenset(int(i[:-1]) for i in items if i.endswith("*")))

    def tokens(self, log: list[str], tokens: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([tokens[log[k]] for k in self.segments])

    def loss_mask(self, log: list[str], tokens: Mapping[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([np.full(len(tokens[log[k]]), k in self.generated) for k in self.segments])

    def span(self, index: int, log: list[str], tokens: Mapping[str, np.ndarray]) -> slice:
        """Where log segment ``index`` sits in this sequence."""
        start = sum(len(tokens[log[k]]) for k in self.segments[: self.segments.index(index)])
        return slice(start, start + len(tokens[log[index]]))


def expected_sequences() -> list[list[ExpectedSequence]]:
    return [[ExpectedSequence.parse(spec) for spec in specs] for specs in SEQUENCES]
