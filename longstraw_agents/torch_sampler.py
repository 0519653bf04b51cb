"""``TorchSampler``: in-process sampling with the engine, batched over every member it is given.

The group's prompt is captured once and forked for the G members; each member's state is then extended with its own
tokens and with the environment's observations, so no turn ever re-prefills the episode. ``generate_batch`` decodes
all the members it is given at once — one forward per generated token for the whole batch (``decoding``), each
group's prompt read once per step for all its members — and members that finish drop out of the batch;
``generate`` decodes one member token by token (``Engine.step``), the reference the batched path is tested against.
``BatchDecoding`` is ``generate_batch`` a step at a time, for a server that interleaves requests.

Storage grows as a turn is decoded, never by a turn's ``max_new_tokens`` up front (a long limit costs nothing
until it is used): a new arena has room for ``FIRST_RESERVE`` positions, or as many again as the turn has decoded
(``generate``: the arenas double), and the batched decoder's buffers double as they fill.

Every member draws from its own ``torch.Generator``, seeded from (sampler seed, member index in fork order), so its
tokens do not depend on which other members share its batch: batched and one-by-one decoding draw the same tokens.
Behaviour logprobs are the log-probabilities of the sampled tokens under the temperature-scaled distribution (before
top-p truncation); train with ``LossConfig(temperature=...)`` equal to the sampling temperature.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from longstraw_agents.engine import Engine
from longstraw_agents.engine.decoding import Decoder, Member, holds_prefix
from longstraw_agents.sampler import FinishReason, Generation, SamplingConfig, check_kept, request_seed
from longstraw_agents.state import State

FIRST_RESERVE = 64
"""Positions allocated ahead of a turn before any is decoded (then as many again as it decoded, see ``_reserve``)."""


def sample_tokens(
    logits: torch.Tensor, config: SamplingConfig, generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """Draw one token per row of ``logits [B, V]``, row b with ``generators[b]``; returns the ids and their
    logprobs under the temperature-scaled distribution.

    A draw is one uniform number from the row's generator, inverted through the row's cumulative distribution, so a
    row's token depends on its logits and its generator only — not on the other rows of the batch."""
    logits = logits.detach().double()
    if config.temperature == 0.0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = torch.argmax(logits, dim=-1)
    else:
        logprobs = torch.log_softmax(logits / config.temperature, dim=-1)
        probs = logprobs.exp()
        if config.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= config.top_p  # keeps at least one token
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
        cdf = torch.cumsum(probs, dim=-1)
        uniform = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators]).to(cdf.device)
        # the first token whose cumulative mass exceeds u · total: a token of zero mass is never drawn
        tokens = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True)[:, 0]
        tokens = tokens.clamp_(max=logits.shape[-1] - 1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1))[:, 0]
    return tokens.tolist(), chosen.tolist()


def sample_token(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator) -> tuple[int, float]:
    """Draw one token from ``logits [V]`` (``sample_tokens`` for one row)."""
    tokens, logprobs = sample_tokens(logits.unsqueeze(0), config, [generator])
    return tokens[0], logprobs[0]


@dataclass
class TorchHandle:
    """A member's position in its episode: the engine state, the next-token logits after it, its own random
    generator and the prompt state it shares with its group (the fork).

    ``marks``: states it may resume from when the environment edits its context, oldest first: the prompt, and with
    ``TorchSampler(keep_marks=True)`` every turn's end and every observation's; the edited context is captured from
    the last mark it keeps."""

    state: State
    next_logits: torch.Tensor
    generator: torch.Generator
    prefix: State | None = None
    history: list[int] = field(default_factory=list, repr=False)
    marks: list[State] = field(default_factory=list, repr=False)


class TorchSampler:
    """In-process sampling with the engine (capture once, fork, decode the members batched, extend per turn)."""

    def __init__(
        self,
        model: torch.nn.Module | Engine,
        stop_token_ids: Sequence[int],
        config: SamplingConfig | None = None,
        *,
        policy_version: int = 0,
        chunk_size: int = 512,
        keep_marks: bool = False,
        graphs: bool | None = None,
    ):
        """keep_marks: keep the state after every generated turn and every observation, so that a context edit
        resumes from the last one it keeps (an eviction recomputes nothing before the output it removes); each costs
        a recurrent state of hybrid models (attention K/V are shared). Without it an edit resumes from the prompt.
        graphs: ``generate_batch`` steps captured in CUDA graphs (``decoding.Decoder``'s ``graphs``; None: where
        the engine runs on CUDA; False: the eager step)."""
        self.keep_marks = keep_marks
        self.graphs = graphs
        self.engine = model if isinstance(model, Engine) else Engine(model, chunk_size=chunk_size)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        if not self.stop_token_ids:
            raise ValueError("stop_token_ids is empty: generation could only end by length")
        self.config = config or SamplingConfig()
        self.policy_version = policy_version
        self.members = 0  # members forked so far: member k draws with the seed request_seed(config.seed, k)

    def fork(self, prompt_ids: Sequence[int], n: int) -> list[TorchHandle]:
        """``n`` members sharing one capture of the prompt, each with its own generator."""
        ids = self._prompt(prompt_ids)
        with torch.no_grad():
            state = self.engine.capture(ids[:-1]) if ids.numel() > 1 else self.engine.empty_state()
            return self._forked(state, ids, n)

    def fork_pausing(self, prompt_ids: Sequence[int], n: int, pause: Callable[[], None]) -> list[TorchHandle]:
        """``fork``, calling ``pause()`` between the prompt's chunks (a server lets other requests step there, and
        ``pause`` may raise to stop a request whose client has gone). The chunks go into one arena sized for the
        whole prompt, as ``Engine.capture`` stores them, and compute what it computes. With context parallelism
        (every rank must make the same calls) it is ``fork``, without pauses."""
        if self.engine.shards is not None:
            return self.fork(prompt_ids, n)
        ids = self._prompt(prompt_ids)
        chunk, captured = self.engine.config.chunk_size, ids.numel() - 1  # (the last token is stepped: logits)
        state = self.engine.empty_state()
        with torch.no_grad():
            for lo in range(0, captured, chunk):
                if lo:
                    pause()
                hi = min(lo + chunk, captured)
                # room for the rest of the prompt, its last token too: what follows appends in place
                state = self.engine.extend(state, ids[lo:hi], reserve=ids.numel() - hi)
            return self._forked(state, ids, n)

    def _prompt(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError("empty prompt")
        return ids

    def _forked(self, state: State, ids: torch.Tensor, n: int) -> list[TorchHandle]:
        """``n`` members after ``state`` (all of ``ids`` but the last) and the prompt's last token."""
        state, logits = self.engine.step(state, ids[-1:], reserve=self._reserve())
        return [
            TorchHandle(state, logits, self._generator(), prefix=state, history=ids.tolist(), marks=[state])
            for _ in range(n)
        ]

    def generate(self, handle: TorchHandle, max_new_tokens: int | None = None) -> Generation:
        """One member's turn, token by token (``Engine.step``)."""
        limit = max_new_tokens or self.config.max_new_tokens
        turn = _Turn(limit)
        with torch.no_grad():
            while not turn.done:
                [token], [logprob] = self._draw(handle.next_logits.unsqueeze(0), [handle.generator])
                turn.add(token, logprob, token in self.stop_token_ids)
                handle.state, handle.next_logits = self.engine.step(
                    handle.state, torch.tensor([token]), reserve=self._reserve(len(turn.ids), limit)
                )
        handle.history.extend(turn.ids)
        self._mark(handle)
        return turn.generation(self.policy_version)

    def generate_batch(
        self, handles: Sequence[TorchHandle], max_new_tokens: Sequence[int | None] | int | None = None
    ) -> list[Generation]:
        """A turn of every member in ``handles``, decoded together: one forward per generated token for all the
        members still generating (a member leaves the batch at its stop token or its token limit).
        max_new_tokens: one limit for all, or one per member (None: the config's)."""
        decoding = BatchDecoding(self, handles, max_new_tokens)
        while not decoding.done:
            decoding.step()
        return [dataclasses.replace(g, policy_version=self.policy_version) for g in decoding.generations()]

    def append(self, handle: TorchHandle, ids: Sequence[int]) -> None:
        """Extend the member's state with ``ids`` (an observation); with context parallelism, one long enough for
        ``Engine.sharded`` is computed sharded over the ranks (all but its last token, whose logits are replicated)."""
        if len(ids) == 0:
            return
        tokens = torch.as_tensor(list(ids), dtype=torch.long)
        with torch.no_grad():
            state = handle.state
            if self.engine.sharded(state, len(tokens) - 1):
                state = self.engine.extend(state, tokens[:-1], reserve=self._reserve())
                tokens = tokens[-1:]
            handle.state, handle.next_logits = self.engine.step(state, tokens, reserve=self._reserve())
        handle.history.extend(int(i) for i in ids)
        self._mark(handle)

    def _mark(self, handle: TorchHandle) -> None:
        if self.keep_marks and handle.state is not handle.marks[-1]:
            handle.marks.append(handle.state)

    def replace(self, handle: TorchHandle, ids: Sequence[int], kept: int) -> None:
        """The environment edited the member's context to ``ids`` (its first ``kept`` tokens unchanged)."""
        self.replace_batch([handle], [ids], [kept])

    def replace_batch(
        self, handles: Sequence[TorchHandle], contexts: Sequence[Sequence[int]], kept: Sequence[int]
    ) -> None:
        """Edited contexts of several members: each is captured from the last of its marks that the edit keeps
        (its positions and state are unchanged), and what members resuming from the same mark have in common
        after it is captured once for all of them (a group's shared prompt, or every token when they agree)."""
        if len({id(h) for h in handles}) != len(handles):
            raise ValueError("replace_batch got the same handle twice")
        empty = self.engine.empty_state()
        requests = [
            _Replacement.of(h, [int(i) for i in c], k, empty) for h, c, k in zip(handles, contexts, kept, strict=True)
        ]
        by_mark: dict[tuple[int, ...], list[_Replacement]] = {}
        for request in requests:  # members whose marks hold the same tokens resume from one of them
            by_mark.setdefault(tuple(request.ids[: request.mark.num_tokens]), []).append(request)
        with torch.no_grad():
            for group in by_mark.values():
                self._resume(group)

    def _resume(self, requests: list[_Replacement]) -> None:
        """Capture the requests' contexts after their common mark: the run they all share once, then each tail."""
        mark, kept_marks = requests[0].mark, requests[0].kept_marks
        tails = [r.ids[mark.num_tokens :] for r in requests]
        common = _common_length(tails) if len(requests) > 1 else 0
        common = min(common, min(len(t) for t in tails) - 1)  # every member steps at least its last token
        shared = self.engine.extend(mark, torch.as_tensor(tails[0][:common], dtype=torch.long)) if common else mark
        for request, tail in zip(requests, tails, strict=True):
            handle = request.handle
            handle.state, handle.next_logits = self.engine.step(
                shared, torch.as_tensor(tail[common:], dtype=torch.long), reserve=self._reserve()
            )
            handle.marks = [*kept_marks, handle.state] if self.keep_marks else list(kept_marks)
            handle.history = request.ids
            if handle.prefix is not None and not holds_prefix(handle.state, handle.prefix):
                # the edit reached into the shared prompt, or the member resumed from another member's mark with
                # the same tokens (another group's copy of the same prompt): share that member's prompt if its
                # state holds it, else decode without one
                leader = requests[0].handle.prefix
                handle.prefix = leader if leader is not None and holds_prefix(handle.state, leader) else None

    def num_tokens(self, handle: TorchHandle) -> int:
        return handle.state.num_tokens

    def complete(self, prompt_ids: Sequence[int], max_new_tokens: int | None = None) -> Generation:
        """One completion of a token prompt (what an OpenAI-compatible server answers)."""
        return self.generate(self.fork(prompt_ids, 1)[0], max_new_tokens)

    def _draw(self, logits: torch.Tensor, generators: Sequence[torch.Generator]) -> tuple[list[int], list[float]]:
        """The next token of each row of ``logits`` and its logprob (``sample_tokens``; ranks that decode together
        draw on one of them)."""
        return sample_tokens(logits, self.config, generators)

    def _generator(self) -> torch.Generator:
        index, self.members = self.members, self.members + 1
        return torch.Generator().manual_seed(request_seed(self.config.seed, index))

    def _reserve(self, decoded: int = 0, limit: int | None = None) -> int:
        """Positions to allocate ahead of a turn that has ``decoded`` tokens when its storage is full: as many
        again (at least ``FIRST_RESERVE``), so that it grows by doubling; never more than the turn's ``limit``
        (default: ``max_new_tokens``) leaves to decode."""
        left = (limit or self.config.max_new_tokens) - decoded
        return max(0, min(left, max(FIRST_RESERVE, decoded)))


class BatchDecoding:
    """A turn of several members decoded together, one batched forward per ``step`` (a ``Decoder``; members leave
    the batch at their stop token or their token limit): ``generate_batch`` steps it to the end, a server steps it
    between other requests' steps and drops it to stop early.

    max_new_tokens: one limit for all, or one per member (None: the sampler's ``max_new_tokens``).
    keep_states: write each member's state back to its handle when it leaves (its history and marks too), so that
        the episode goes on; without, nothing continues the turns and no state is written (a server's answers): a
        member that ends is dropped before the step that would feed its last token.
    """

    def __init__(
        self,
        sampler: TorchSampler,
        handles: Sequence[TorchHandle],
        max_new_tokens: Sequence[int | None] | int | None = None,
        *,
        keep_states: bool = True,
    ):
        if len({id(h) for h in handles}) != len(handles):
            raise ValueError("generate_batch got the same handle twice")
        limits = max_new_tokens if isinstance(max_new_tokens, Sequence) else [max_new_tokens] * len(handles)
        if len(limits) != len(handles):
            raise ValueError(f"{len(handles)} handles but {len(limits)} token limits")
        self.sampler, self.handles, self.keep_states = sampler, list(handles), keep_states
        self.turns = [_Turn(limit or sampler.config.max_new_tokens) for limit in limits]
        self._members = [k for k, turn in enumerate(self.turns) if not turn.done]  # handle of each decoder member
        self._decoder: Decoder | None = None
        self._logits: torch.Tensor | None = None
        self._recorded = False  # the turns joined the handles' histories
        if self._members:
            members = [Member(self.handles[k].state, self.handles[k].prefix) for k in self._members]
            self._decoder = Decoder(sampler.engine, members, reserve=sampler._reserve(), graphs=sampler.graphs)
            self._logits = torch.stack([self.handles[k].next_logits for k in self._members])

    @property
    def done(self) -> bool:
        return self._decoder is None

    def step(self) -> list[tuple[int, int, float]]:
        """Draw the next token of every member still decoding and feed it (one forward); returns each one's
        ``(member index, token, logprob)``, in member order."""
        decoder, logits = self._decoder, self._logits
        if decoder is None or logits is None:
            raise ValueError("every member's turn has ended")
        members = [self._members[j] for j in decoder.live]
        tokens, logprobs = self.sampler._draw(logits, [self.handles[k].generator for k in members])
        for k, token, logprob in zip(members, tokens, logprobs, strict=True):
            self.turns[k].add(token, logprob, token in self.sampler.stop_token_ids)
        ended = [row for row, k in enumerate(members) if self.turns[k].done]
        going = [row for row, k in enumerate(members) if not self.turns[k].done]
        with torch.no_grad():
            if self.keep_states:
                logits = decoder.step(tokens)
                for row, state in zip(ended, decoder.leave([decoder.live[row] for row in ended]), strict=True):
                    self.handles[members[row]].state, self.handles[members[row]].next_logits = state, logits[row]
                self._logits = logits[going]
            else:
                decoder.drop([decoder.live[row] for row in ended])
                self._logits = decoder.step([tokens[row] for row in going]) if going else None
        if not decoder.live:
            self._decoder = self._logits = None  # the batch's buffers go now
        return [(k, token, logprob) for k, token, logprob in zip(members, tokens, logprobs, strict=True)]

    def generations(self) -> list[Generation]:
        """Each member's turn (call when ``done``); with ``keep_states`` its tokens join the handle's history."""
        if not self.done:
            raise ValueError("the members are still decoding")
        if self.keep_states and not self._recorded:
            for handle, turn in zip(self.handles, self.turns, strict=True):
                handle.history.extend(turn.ids)
                self.sampler._mark(handle)
            self._recorded = True
        return [turn.generation() for turn in self.turns]


@dataclass
class _Replacement:
    """One member's edited context ``ids`` and the last of its marks within the ``kept`` tokens."""

    handle: TorchHandle
    ids: list[int]
    kept_marks: list[State]

    @property
    def mark(self) -> State:
        return self.kept_marks[-1]

    @classmethod
    def of(cls, handle: TorchHandle, ids: list[int], kept: int, empty: State) -> _Replacement:
        """``empty``: where to start when the edit keeps less than the prompt."""
        check_kept(handle.history, ids, kept)
        if len(ids) <= kept:
            raise ValueError("an edited context must hold new tokens after the ones it keeps")
        return cls(handle, ids, [m for m in handle.marks if m.num_tokens <= kept] or [empty])


def _common_length(rows: list[list[int]]) -> int:
    """Length of the longest common prefix of ``rows``."""
    first = rows[0]
    length = min(len(row) for row in rows)
    for row in rows[1:]:
        for k in range(length):
            if row[k] != first[k]:
                length = k
                break
    return length


class _Turn:
    """The tokens of one member's turn so far, and whether it has ended (stop token or limit)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.finish: FinishReason = "length"
        self.done = limit <= 0

    def add(self, token: int, logprob: float, stop: bool) -> None:
        self.ids.append(token)
        self.logprobs.append(logprob)
        if stop:
            self.finish = "stop"
        self.done = stop or len(self.ids) >= self.limit

    def generation(self, policy_version: int | None = None) -> Generation:
        return Generation(self.ids, self.logprobs, self.finish, policy_version)
