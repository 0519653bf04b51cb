"""Batched decoding checked against stepping each member alone (tests/test_decoding.py, and context-parallel in
tests/parallel/test_fsdp.py): the same teacher-forced tokens both ways, the largest log-probability gap."""

from __future__ import annotations

import torch

from longstraw_agents.engine import Engine
from longstraw_agents.engine.decoding import Decoder, Member
from longstraw_agents.state import State

VOCAB = 256
STEPS = 10
DROPPED, DROP_AT = [1, 3, 4], 4  # after 4 tokens, member 1 and all of the second group (3, 4) leave the batch
TOOL_MEMBER, TOOL_AT, TOOL_IDS = 0, 6, [3, 1, 4, 1, 5]  # member 0 gets an observation after 6 tokens


def forced_tokens(members: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (members, STEPS), generator=torch.Generator().manual_seed(seed))


def max_logprob_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((torch.log_softmax(a.double(), -1) - torch.log_softmax(b.double(), -1)).abs().max())


def step_both(engine: Engine, decoder: Decoder, alone: list[State], column: torch.Tensor, index: list[int]) -> float:
    """One token for each member in the decoder's batch (``index[k]``: member k of the decoder, globally), and the
    same token for each of those members stepped alone with ``engine``; the largest log-probability difference."""
    live = [index[k] for k in decoder.live]
    logits = decoder.step(column[live])
    gap = 0.0
    for row, b in enumerate(live):
        alone[b], reference = engine.step(alone[b], column[b : b + 1], reserve=3)
        gap = max(gap, max_logprob_gap(logits[row], reference))
    return gap


def decode_both_ways(
    engine: Engine,
    prompts: list[list[int]],
    group_sizes: list[int],
    reference: Engine | None = None,
    graphs: bool | None = None,
) -> float:
    """Teacher-force the same tokens through batched decoding and through ``Engine.step`` member by member; the
    largest log-probability difference seen (also of the logits read from the final states with
    ``Engine.logits``). The last prompt's members share nothing (``prefix=None``). Two decode sessions: in the
    first, some members (a whole group among them) leave early; between them, a tool turn extends one member.
    ``reference``: the engine that steps the members alone (default ``engine``; e.g. one process's, while
    ``engine`` decodes context-parallel). ``graphs``: the decoders' (``Decoder``)."""
    reference = reference or engine
    members: list[Member] = []
    alone: list[State] = []
    for index, (prompt, size) in enumerate(zip(prompts, group_sizes, strict=True)):
        fork = engine.capture(prompt)
        alone_fork = fork if reference is engine else reference.capture(prompt)
        members += [Member(fork, fork if index < len(prompts) - 1 else None) for _ in range(size)]
        alone += [alone_fork] * size
    tokens = forced_tokens(len(members))
    everyone = list(range(len(members)))
    gap = 0.0

    decoder = Decoder(engine, members, reserve=3, graphs=graphs)
    for t in range(TOOL_AT + 1):
        if t == DROP_AT:
            for b, state in zip(DROPPED, decoder.leave(DROPPED), strict=True):
                members[b] = Member(state, members[b].prefix)
        gap = max(gap, step_both(reference, decoder, alone, tokens[:, t], everyone))
    live = list(decoder.live)
    for b, state in zip(live, decoder.leave(live), strict=True):
        members[b] = Member(state, members[b].prefix)

    tool = members[TOOL_MEMBER]  # a tool turn: the observation extends the member's state as the rollout does
    members[TOOL_MEMBER] = Member(engine.extend(tool.state, TOOL_IDS), tool.prefix)
    alone[TOOL_MEMBER] = reference.extend(alone[TOOL_MEMBER], TOOL_IDS)

    rest = [b for b in everyone if b not in DROPPED]
    decoder = Decoder(engine, [members[b] for b in rest], reserve=3, graphs=graphs)
    for t in range(TOOL_AT + 1, STEPS):
        gap = max(gap, step_both(reference, decoder, alone, tokens[:, t], rest))
    for b, state in zip(rest, decoder.leave(range(len(rest))), strict=True):
        members[b] = Member(state, members[b].prefix)

    probe = [7, 8, 9]
    with torch.no_grad():
        for member, state in zip(members, alone, strict=True):
            assert member.state.num_tokens == state.num_tokens
            gap = max(gap, max_logprob_gap(engine.logits(member.state, probe), reference.logits(state, probe)))
    return gap


# two groups (prompt lengths 20 and 5: past and within the tiny DSA preset's index_topk of 8) and one lone member
PROMPTS = [list(range(10, 30)), [40, 41, 42, 43, 44], [50, 51, 52]]
GROUPS = [3, 2, 1]
