"""Rollouts on the mesh: the cp ranks of a dp rank sample together, every member's state spread over them.

The first rank of the cp group, the *leader* (``LeadingSampler``), runs the environments and calls the sampler as
one process would. Before each call that runs the engine it posts the call to its cp peers, the *followers*
(``FollowingSampler.follow``), which make the same call on their own sampler: every rank then runs the engine's
collectives (a sharded capture, a decode step's merged attention, a layer's gather) in the same order. Within a
turn the leader draws each step's tokens and broadcasts them; the followers' members decode the same tokens. Each
rank stores its share of every path (``BalancedOwnership``), so a rollout holds 1/cp of its members' states per rank.

    leader:    sampler = LeadingSampler(engine, stop_ids, config, calls=SamplerCalls(cp_group))
               ... rollout_groups(env_factory, sampler, ...) ...; sampler.close()
    followers: FollowingSampler(engine, stop_ids, config, calls=SamplerCalls(cp_group)).follow()

Only the leader's generations are real; a follower's calls return what its replica computed (tokens the leader drew,
logprobs 0). The environments never run on a follower, so they need not be deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from longstraw_agents.engine import Engine
from longstraw_agents.sampler import Generation, SamplingConfig
from longstraw_agents.torch_sampler import TorchHandle, TorchSampler

LEADER = 0  # the rank of the cp group that runs the environments


class SamplerCalls:
    """The leader's sampler calls and drawn tokens, broadcast over the cp ``group`` (tokens on ``device``)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device | str = "cpu"):
        self.group, self.device = group, torch.device(device)

    @property
    def leads(self) -> bool:
        return dist.get_rank(self.group) == LEADER

    def post(self, name: str, *args: Any) -> None:
        """The leader's call ``name(*args)`` (handles given as their indices), to the followers."""
        self._broadcast((name, args))

    def receive(self) -> tuple[str, tuple[Any, ...]]:
        """The leader's next call (a follower)."""
        call = self._broadcast(None)
        assert call is not None
        return call

    def tokens(self, drawn: list[int] | None, count: int) -> list[int]:
        """The leader's ``count`` tokens drawn for a decode step (given on the leader, received elsewhere)."""
        box = torch.zeros(count, dtype=torch.long, device=self.device)
        if drawn is not None:
            box.copy_(torch.as_tensor(drawn, dtype=torch.long))
        dist.broadcast(box, group=self.group, group_src=LEADER)
        return box.tolist()

    def _broadcast(self, call: tuple[str, tuple[Any, ...]] | None) -> tuple[str, tuple[Any, ...]] | None:
        box: list[Any] = [call]
        dist.broadcast_object_list(box, group=self.group, group_src=LEADER, device=self.device)
        return box[0]


DONE = "done"


class LeaderFailed(RuntimeError):
    """The leading cp rank's rollout raised: its followers stop too, instead of waiting in the next collective."""


class _CpRankSampler(TorchSampler):
    """A ``TorchSampler`` over the cp-sharded engine on one rank of the cp group: the first (``leads``) or another.
    ``handles``: every handle made, in order (kept, so that an id is never reused)."""

    leads: ClassVar[bool]

    def __init__(
        self,
        engine: Engine,
        stop_token_ids: Sequence[int],
        config: SamplingConfig | None = None,
        *,
        calls: SamplerCalls,
        **options: Any,
    ):
        if calls.leads != self.leads:
            where = f"rank {LEADER}" if self.leads else f"a rank other than {LEADER}"
            rank = dist.get_rank(calls.group)
            raise ValueError(f"a {type(self).__name__} runs on {where} of its cp group, not on rank {rank}")
        super().__init__(engine, stop_token_ids, config, **options)
        self.calls = calls
        self.handles: list[TorchHandle] = []


class LeadingSampler(_CpRankSampler):
    """The leader's sampler: a ``TorchSampler`` over the cp-sharded engine whose engine-running calls are posted to
    the followers first, and whose draws are broadcast to them. ``close`` ends the followers' loop."""

    leads = True

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._index: dict[int, int] = {}  # id(handle) -> its index in handles

    def fork(self, prompt_ids: Sequence[int], n: int) -> list[TorchHandle]:
        self.calls.post("fork", [int(i) for i in prompt_ids], n)
        handles = super().fork(prompt_ids, n)
        for handle in handles:
            self._index[id(handle)] = len(self.handles)
            self.handles.append(handle)
        return handles

    def generate(self, handle: TorchHandle, max_new_tokens: int | None = None) -> Generation:
        self.calls.post("generate", self._indices([handle])[0], max_new_tokens)
        return super().generate(handle, max_new_tokens)

    def generate_batch(
        self, handles: Sequence[TorchHandle], max_new_tokens: Sequence[int | None] | int | None = None
    ) -> list[Generation]:
        limits = list(max_new_tokens) if isinstance(max_new_tokens, Sequence) else max_new_tokens
        self.calls.post("generate_batch", self._indices(handles), limits)
        return super().generate_batch(handles, max_new_tokens)

    def append(self, handle: TorchHandle, ids: Sequence[int]) -> None:
        self.calls.post("append", self._indices([handle])[0], [int(i) for i in ids])
        super().append(handle, ids)

    def replace_batch(
        self, handles: Sequence[TorchHandle], contexts: Sequence[Sequence[int]], kept: Sequence[int]
    ) -> None:
        contexts = [[int(i) for i in c] for c in contexts]
        self.calls.post("replace_batch", self._indices(handles), contexts, list(kept))
        super().replace_batch(handles, contexts, kept)

    def close(self, failed: bool = False) -> None:
        """End the followers' loop: every rollout call has been made, or (``failed``) the leader's rollout failed,
        and so do the followers, at once."""
        self.calls.post(DONE, failed)

    def _draw(self, logits: torch.Tensor, generators: Sequence[torch.Generator]) -> tuple[list[int], list[float]]:
        tokens, logprobs = super()._draw(logits, generators)
        self.calls.tokens(tokens, len(tokens))
        return tokens, logprobs

    def _indices(self, handles: Sequence[TorchHandle]) -> list[int]:
        try:
            return [self._index[id(handle)] for handle in handles]
        except KeyError:
            raise ValueError("a handle this sampler did not fork") from None


class FollowingSampler(_CpRankSampler):
    """A follower's sampler: ``follow`` makes the leader's calls on its own replicas of the members until the
    leader's ``close``, decoding the tokens the leader drew."""

    leads = False

    def follow(self) -> int:
        """Make the leader's calls until it closes; returns how many calls were made. A call that fails here (it
        fails on the leader too: the same call on the same state) stops the calls being made, not the loop: the
        leader's close ends it, and then the failure is raised, as is ``LeaderFailed`` when the leader's rollout
        failed."""
        made, failure = 0, None
        while True:
            name, args = self.calls.receive()
            if name == DONE:
                if failure is not None:
                    raise failure
                if args[0]:
                    raise LeaderFailed("the leading cp rank's rollout failed (see its error)")
                return made
            if failure is None:
                try:
                    self._make(name, args)
                except Exception as err:  # noqa: BLE001 - raised once the leader closes
                    failure = err
            made += 1

    def _make(self, name: str, args: tuple[Any, ...]) -> None:
        if name == "fork":
            self.handles.extend(self.fork(*args))
        elif name == "generate":
            index, limit = args
            self.generate(self.handles[index], limit)
        elif name == "generate_batch":
            indices, limits = args
            self.generate_batch([self.handles[k] for k in indices], limits)
        elif name == "append":
            index, ids = args
            self.append(self.handles[index], ids)
        elif name == "replace_batch":
            indices, contexts, kept = args
            self.replace_batch([self.handles[k] for k in indices], contexts, kept)
        else:
            raise ValueError(f"unknown sampler call {name!r} from the leader")

    def _draw(self, logits: torch.Tensor, generators: Sequence[torch.Generator]) -> tuple[list[int], list[float]]:
        count = logits.shape[0]
        return self.calls.tokens(None, count), [0.0] * count
