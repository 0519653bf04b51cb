"""GRPO backward over one group, in three execution modes with the same loss:

- ``naive``: one full autograd graph per member over its whole sequence — the reference; memory grows with
  context × G.
- ``detached``: the shared context is evaluated once without a graph and each loss segment is replayed under
  autograd from it; the gradient through the context state is dropped (the published LongStraw system).
- ``exact``: as detached, but the gradient w.r.t. the context state is accumulated over all branches and
  backpropagated through the context by recomputing its chunks in reverse (DESIGN.md, "Exact gradients"); equals
  naive's gradient with peak memory ≈ states on the active root→leaf path + their gradient + one chunk graph.

The tree modes walk the group's prefix tree depth first (``longstraw_agents.segmenter``). ``grpo_backward``
accumulates into ``param.grad`` and returns statistics; it never steps an optimizer.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn

from longstraw_agents.engine import Engine
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.segmenter import Member, Node, PrefixTree, build_tree, fuse_chains, nodes_with_loss_below
from longstraw_agents.state import State, StateGrad
from longstraw_agents.trainer.loss import (
    AGGREGATIONS,
    LossConfig,
    MemberTerms,
    group_advantages,
    per_token_loss,
    token_logprobs,
)
from longstraw_agents.trajectory import Trajectory

ModeName = Literal["naive", "detached", "exact"]


@dataclass
class Group:
    """A GRPO group ready for the loss: its prefix tree and each member's advantage and weight."""

    tree: PrefixTree
    terms: list[MemberTerms]
    rewards: list[float]

    @property
    def members(self) -> list[Member]:
        return self.tree.members

    @property
    def num_loss_tokens(self) -> int:
        return sum(m.num_loss_tokens for m in self.members)


def make_group(members: Sequence[Member], rewards: Sequence[float], config: LossConfig) -> Group:
    members = list(members)
    if len(rewards) != len(members):
        raise ValueError(f"{len(rewards)} rewards for {len(members)} members")
    advantages = group_advantages(rewards, scale=config.scale_rewards).tolist()
    lengths = [m.num_loss_tokens for m in members]
    if sum(lengths) == 0:
        raise ValueError("no member has a loss token (check the loss masks / completions)")
    weights = AGGREGATIONS[config.aggregation].weights(lengths, config)
    terms = [MemberTerms(advantage=a, weight=w) for a, w in zip(advantages, weights, strict=True)]
    return Group(tree=build_tree(members), terms=terms, rewards=[float(r) for r in rewards])


@dataclass
class WalkStats:
    loss: float = 0.0
    nodes: int = 0
    forward_tokens: int = 0  # tokens run through the policy (graph or not), recomputation included
    kl_sum: float = 0.0
    kl_tokens: int = 0


class NodeLoss:
    """The loss of one node's targets, summed over the members that put loss there (vectorised over members)."""

    def __init__(self, group: Group, node: Node, config: LossConfig, device: torch.device):
        self.config = config
        self.targets = torch.as_tensor(node.targets, dtype=torch.long, device=device)
        members = [i for i in node.members if node.masks[i].any()]
        self.members = members
        self.mask = torch.as_tensor(np.stack([node.masks[i] for i in members]), device=device)
        self.advantage = torch.tensor([group.terms[i].advantage for i in members], dtype=torch.float64, device=device)
        self.weight = torch.tensor([group.terms[i].weight for i in members], dtype=torch.float64, device=device)
        old = [node.logprobs[i] for i in members]
        self.old = None
        if any(lp is not None for lp in old):
            rows = [lp if lp is not None else np.full(len(self.targets), np.nan) for lp in old]
            self.old = torch.as_tensor(np.stack(rows), dtype=torch.float64, device=device)
        self.ref: Tensor | None = None  # reference log-probs of the targets, set by the walk when beta > 0

    def __call__(self, logits: Tensor, lo: int, hi: int, stats: WalkStats) -> Tensor:
        """Loss of rows ``[lo, hi)`` of the node given their logits."""
        logp = token_logprobs(logits, self.targets[lo:hi], self.config.temperature).to(torch.float64)
        mask = self.mask[:, lo:hi]
        old = None if self.old is None else self.old[:, lo:hi]
        ref = None if self.ref is None else self.ref[lo:hi].to(torch.float64)
        per_token = per_token_loss(
            logp.unsqueeze(0).expand_as(mask), self.advantage.unsqueeze(1), self.config, old, ref
        )
        loss = (per_token * mask * self.weight.unsqueeze(1)).sum()
        stats.loss += float(loss.detach())
        if ref is not None:
            delta = ref - logp.detach()
            kl = (torch.exp(delta) - delta - 1.0).unsqueeze(0).expand_as(mask)
            stats.kl_sum += float(kl[mask].sum())
            stats.kl_tokens += int(mask.sum())
        return loss.to(logits.dtype)


class ExecutionMode(ABC):
    """How one group's loss is evaluated and backpropagated."""

    name: str

    def __init__(self, engine: Engine, config: LossConfig, ref_engine: Engine | None = None):
        self.engine = engine
        self.config = config
        self.ref_engine = ref_engine if config.beta > 0 else None
        if config.beta > 0 and ref_engine is None:
            raise ValueError("beta > 0 needs a reference model (ref_model=...)")

    @abstractmethod
    def run(self, group: Group, stats: WalkStats) -> None: ...

    def _ids(self, array: np.ndarray) -> Tensor:
        return torch.as_tensor(array, dtype=torch.long, device=self.engine.adapter.device)


class NaiveMode(ExecutionMode):
    """One full graph per member over its whole sequence, all G alive until one backward (the reference, and how
    a conventional trainer batches a group)."""

    name = "naive"

    def run(self, group: Group, stats: WalkStats) -> None:
        total = None
        for k, member in enumerate(group.members):
            if not member.loss_mask[1:].any():
                continue
            ids = self._ids(member.token_ids)
            targets = ids[1:]
            logits = self.engine.logits(self.engine.empty_state(), ids[:-1])
            stats.forward_tokens += ids.shape[0] - 1
            logp = token_logprobs(logits, targets, self.config.temperature).to(torch.float64)
            mask = torch.as_tensor(member.loss_mask[1:], device=ids.device)
            old = None if member.logprobs is None else torch.as_tensor(member.logprobs[1:], device=ids.device)
            ref = None
            if self.ref_engine is not None:
                with torch.no_grad():
                    ref_logits = self.ref_engine.logits(self.ref_engine.empty_state(), ids[:-1])
                ref = token_logprobs(ref_logits, targets, self.config.temperature).to(torch.float64)
                delta = ref - logp.detach()
                stats.kl_sum += float(((torch.exp(delta) - delta - 1.0) * mask).sum())
                stats.kl_tokens += int(mask.sum())
            term = group.terms[k]
            per_token = per_token_loss(logp, term.advantage, self.config, old, ref)
            loss = (per_token * mask).sum() * term.weight
            stats.loss += float(loss.detach())
            total = loss if total is None else total + loss
            stats.nodes += 1
        if total is not None:
            total.backward()


@dataclass
class _Pending:
    """An interior node whose children are being walked; finished (post-order) when popped off the stack."""

    node: Node
    inputs: Tensor
    parent: State
    state: State
    ref_state: State | None
    loss: NodeLoss | None


class TreeMode(ExecutionMode):
    """Depth-first walk of the prefix tree; subclasses say how interior and leaf nodes are processed.

    The walk uses an explicit stack (trees of thousands of turns are as deep). An interior node is extended with
    room reserved for the single-child chain below it, so the chain lands contiguous in one arena per layer and
    attention reads it as one block; siblings at a branch point get fresh storage (an append goes in place only at
    the fill mark), so every state on the active path stays valid.
    """

    checkpoints = False

    def tree(self, group: Group) -> PrefixTree:
        return group.tree

    def run(self, group: Group, stats: WalkStats) -> None:
        self.group, self.stats = group, stats
        self.grad = StateGrad()
        tree = self.tree(group)
        self.live = nodes_with_loss_below(tree.root)
        self.reserve = _chain_reserve(tree.root, self.live)
        root_state = self.engine.empty_state(self.checkpoints)
        ref_root = self.ref_engine.empty_state() if self.ref_engine is not None else None
        stack: list[tuple[Node, State, State | None] | _Pending] = []
        if id(tree.root) in self.live:
            stack.append((tree.root, root_state, ref_root))
        while stack:
            item = stack.pop()
            if isinstance(item, _Pending):
                if item.inputs.numel():
                    self.interior(item.node, item.inputs, item.parent, item.state, item.loss)
                continue
            pending = self._enter(*item)
            if pending is not None:
                stack.append(pending)
                live = [c for c in pending.node.children if id(c) in self.live]
                stack.extend((c, pending.state, pending.ref_state) for c in reversed(live))

    def _enter(self, node: Node, parent: State, ref_parent: State | None) -> _Pending | None:
        """Pre-order work: a leaf is processed now; an interior node is extended and returned to finish later."""
        self.stats.nodes += 1
        inputs = self._ids(node.input_ids)
        loss = NodeLoss(self.group, node, self.config, inputs.device) if node.has_loss else None
        if loss is not None and self.ref_engine is not None and inputs.numel():
            with torch.no_grad():
                ref_logits = self.ref_engine.logits(ref_parent, inputs)
                loss.ref = token_logprobs(ref_logits, loss.targets, self.config.temperature)
        if not any(id(c) in self.live for c in node.children):
            if loss is not None and inputs.numel():
                self.leaf(node, inputs, parent, loss)
            return None
        if not inputs.numel():  # the virtual root of a group without a shared first token
            return _Pending(node, inputs, parent, parent, ref_parent, None)
        reserve = self.reserve.get(id(node), 0)
        state = self.engine.extend(parent, inputs, reserve=reserve)
        self.stats.forward_tokens += inputs.numel()
        ref_state = ref_parent
        if self.ref_engine is not None:
            ref_state = self.ref_engine.extend(ref_parent, inputs, reserve=reserve)
        return _Pending(node, inputs, parent, state, ref_state, loss)

    def _loss_fn(self, loss: NodeLoss, base: int):
        def chunk_loss(logits: Tensor, start: int, end: int) -> Tensor:
            return loss(logits, start - base, end - base, self.stats)

        return chunk_loss

    @abstractmethod
    def leaf(self, node: Node, inputs: Tensor, parent: State, loss: NodeLoss) -> None: ...

    @abstractmethod
    def interior(self, node: Node, inputs: Tensor, parent: State, state: State, loss: NodeLoss | None) -> None:
        """Called after all children are done (post-order)."""


class DetachedMode(TreeMode):
    """Loss segments replayed from a constant state: gradients never reach the context (the seed's behaviour)."""

    name = "detached"

    def leaf(self, node: Node, inputs: Tensor, parent: State, loss: NodeLoss) -> None:
        self._replay(inputs, parent, loss)

    def interior(self, node: Node, inputs: Tensor, parent: State, state: State, loss: NodeLoss | None) -> None:
        if loss is not None:
            self._replay(inputs, parent, loss)

    def _replay(self, inputs: Tensor, parent: State, loss: NodeLoss) -> None:
        logits = self.engine.logits(parent, inputs)
        self.stats.forward_tokens += inputs.numel()
        loss(logits, 0, inputs.numel(), self.stats).backward()


class ExactMode(TreeMode):
    """Branch gradients w.r.t. the state are accumulated, then pushed through the context chunk by chunk."""

    name = "exact"
    checkpoints = True

    def tree(self, group: Group) -> PrefixTree:
        # every interior node is extended and recomputed in chunks whether or not it has loss, so runs of short
        # turns fuse without changing the gradient; long context stays apart (no lm_head over it in backward)
        return fuse_chains(group.tree, max_context=self.engine.config.chunk_size)

    def leaf(self, node: Node, inputs: Tensor, parent: State, loss: NodeLoss) -> None:
        logits = self.engine.logits(parent, inputs, grad=self.grad)
        self.stats.forward_tokens += inputs.numel()
        loss(logits, 0, inputs.numel(), self.stats).backward()

    def interior(self, node: Node, inputs: Tensor, parent: State, state: State, loss: NodeLoss | None) -> None:
        loss_fn = self._loss_fn(loss, parent.num_tokens) if loss is not None else None
        self.engine.backward(state, self.grad, inputs, since=parent, loss_fn=loss_fn)
        self.stats.forward_tokens += inputs.numel()


def _chain_reserve(root: Node, live: set[int]) -> dict[int, int]:
    """Per interior node: the input tokens of the single-child chain of interior nodes below it (what later
    extends will append right after it), so the whole chain can land in the storage its first extend allocates."""
    reserve: dict[int, int] = {}
    for node in list(root.walk())[::-1]:  # reversed pre-order: every node after its descendants
        children = [c for c in node.children if id(c) in live]
        if len(children) != 1:
            continue
        child = children[0]
        if any(id(c) in live for c in child.children):  # the child is extended too (a leaf is only replayed)
            reserve[id(node)] = len(child.input_ids) + reserve.get(id(child), 0)
    return reserve


MODES: dict[str, type[ExecutionMode]] = {m.name: m for m in (NaiveMode, DetachedMode, ExactMode)}


@dataclass
class BackwardResult:
    """Statistics of one ``grpo_backward`` call (``as_dict`` gives the plain dict)."""

    loss: float
    mode: str
    num_members: int
    loss_tokens: int
    unique_tokens: int
    forward_tokens: int
    nodes: int
    peak_bytes: int | None
    seconds: float
    advantages: list[float]
    rewards: list[float]
    kl: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "extra"}
        out.update(self.extra)
        return out


def backward_group(
    engine: Engine,
    group: Group,
    mode: ModeName = "exact",
    config: LossConfig | None = None,
    ref_engine: Engine | None = None,
    track_memory: bool = True,
) -> BackwardResult:
    """Accumulate the group's GRPO gradient into ``param.grad`` with the chosen execution mode."""
    config = config or LossConfig()
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {sorted(MODES)}")
    runner = MODES[mode](engine, config, ref_engine)
    stats = WalkStats()
    tracker = MemoryTracker() if track_memory else None
    start = time.perf_counter()
    if tracker is not None:
        with tracker:
            runner.run(group, stats)
    else:
        runner.run(group, stats)
    return BackwardResult(
        loss=stats.loss,
        mode=mode,
        num_members=len(group.members),
        loss_tokens=group.num_loss_tokens,
        unique_tokens=group.tree.num_unique_tokens,
        forward_tokens=stats.forward_tokens,
        nodes=stats.nodes,
        peak_bytes=tracker.peak_bytes if tracker is not None else None,
        seconds=time.perf_counter() - start,
        advantages=[t.advantage for t in group.terms],
        rewards=group.rewards,
        kl=stats.kl_sum / stats.kl_tokens if stats.kl_tokens else None,
    )


def _engine_for(model: nn.Module | Engine, chunk_size: int | None) -> Engine:
    if isinstance(model, Engine):
        return model
    return Engine(model, chunk_size=chunk_size) if chunk_size else Engine(model)


def grpo_backward(
    model: nn.Module | Engine,
    prompt_ids: Tensor | Sequence[int],
    completions: Sequence[Tensor | Sequence[int]],
    rewards: Sequence[float],
    mode: ModeName = "exact",
    *,
    config: LossConfig | None = None,
    old_logprobs: Sequence[Sequence[float] | Tensor | None] | None = None,
    ref_model: nn.Module | Engine | None = None,
    chunk_size: int | None = None,
    track_memory: bool = True,
) -> dict[str, Any]:
    """GRPO gradient of one group sharing ``prompt_ids``, accumulated into ``param.grad``.

    completions: G 1-D token tensors; rewards: G floats; old_logprobs: optional behaviour log-probs per completion
    (on-policy when omitted). Returns a dict with "loss", token counts and "peak_bytes" (tracked tensor bytes).
    """
    config = config or LossConfig()
    prompt = token_array(prompt_ids, "prompt_ids")
    if prompt.size == 0:
        raise ValueError("prompt_ids is empty")
    completions = _completion_list(completions)
    if old_logprobs is not None and len(old_logprobs) != len(completions):
        raise ValueError(
            f"old_logprobs has {len(old_logprobs)} entries for {len(completions)} completions "
            "(one per completion, None where unknown)"
        )
    members = []
    for k, completion in enumerate(completions):
        comp = token_array(completion, f"completion {k}")
        if comp.size == 0:
            raise ValueError(f"completion {k} is empty")
        lp = None
        if old_logprobs is not None and old_logprobs[k] is not None:
            lp = _float_array(old_logprobs[k], f"old_logprobs[{k}]")
        members.append(Member.from_prompt_completion(prompt, comp, lp))
    engine = _engine_for(model, chunk_size)
    ref_engine = _engine_for(ref_model, chunk_size) if ref_model is not None else None
    group = make_group(members, rewards, config)
    result = backward_group(engine, group, mode, config, ref_engine, track_memory)
    result.extra["prompt_tokens"] = int(prompt.size)
    return result.as_dict()


def grpo_backward_trajectories(
    model: nn.Module | Engine,
    trajectories: Sequence[Trajectory],
    rewards: Sequence[float] | None = None,
    mode: ModeName = "exact",
    *,
    config: LossConfig | None = None,
    ref_model: nn.Module | Engine | None = None,
    chunk_size: int | None = None,
    track_memory: bool = True,
) -> dict[str, Any]:
    """The tree form: whole multi-turn trajectories (loss masks and behaviour logprobs from the segments)."""
    config = config or LossConfig()
    if rewards is None:
        missing = [k for k, t in enumerate(trajectories) if t.reward is None]
        if missing:
            raise ValueError(f"trajectories {missing} have no reward; pass rewards=...")
        rewards = [float(t.reward) for t in trajectories]
    members = [Member.from_trajectory(t) for t in trajectories]
    engine = _engine_for(model, chunk_size)
    ref_engine = _engine_for(ref_model, chunk_size) if ref_model is not None else None
    group = make_group(members, rewards, config)
    return backward_group(engine, group, mode, config, ref_engine, track_memory).as_dict()


def _completion_list(completions: Sequence[Tensor | Sequence[int]]) -> list[Tensor | Sequence[int]]:
    if isinstance(completions, Tensor):  # a padded batch would silently train on its padding
        raise TypeError(
            f"completions must be a list of G 1-D token tensors (one per member), got a tensor of shape "
            f"{tuple(completions.shape)}; pass list(completions) if its rows are unpadded completions"
        )
    completions = list(completions)
    if not completions:
        raise ValueError("completions is empty")
    return completions


def _one_d(values: Tensor | Sequence, what: str) -> np.ndarray:
    if isinstance(values, Tensor):
        if values.dim() != 1:
            raise ValueError(f"{what}: expected a 1-D tensor, got shape {tuple(values.shape)}")
        values = values.detach().cpu()
        return (values.float() if values.dtype == torch.bfloat16 else values).numpy()  # numpy has no bfloat16
    try:
        array = np.asarray(values)
    except (TypeError, ValueError) as err:  # ragged nesting
        raise ValueError(f"{what}: expected a 1-D sequence of numbers: {err}") from None
    if array.ndim != 1:
        raise ValueError(f"{what}: expected a 1-D sequence, got shape {array.shape}")
    return array


def token_array(values: Tensor | Sequence[int], what: str) -> np.ndarray:
    """1-D int64 token ids. Floats and bools are refused, never truncated ([3.9, 4.0] is not [3, 4])."""
    array = _one_d(values, what)
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{what}: token ids must be integers, got dtype {array.dtype}")
    return array.astype(np.int64)


def _float_array(values: Tensor | Sequence[float], what: str) -> np.ndarray:
    """1-D float64 log-probs (ints are fine; bools and strings are not numbers here)."""
    array = _one_d(values, what)
    if array.size and array.dtype.kind not in "iuf":
        raise TypeError(f"{what}: expected real numbers, got dtype {array.dtype}")
    return array.astype(np.float64)
