"""Execution modes: how one group's GRPO loss is evaluated and backpropagated. All three give the same loss value;
they differ in what they keep alive and in whether the gradient reaches the shared context.

- ``naive``: one full autograd graph per member over its whole sequence — the reference; memory grows with
  context × G.
- ``detached``: the shared context is evaluated once without a graph and each loss segment is replayed under
  autograd from it; the gradient through the context state is dropped (the published LongStraw system).
- ``exact``: as detached, but the gradient w.r.t. the context state is accumulated over all branches and
  backpropagated through the context by recomputing its chunks in reverse (DESIGN.md, "Exact gradients"); equals
  naive's gradient with peak memory ≈ states on the active root→leaf path + their gradient + one chunk graph.

The tree modes walk the group's prefix tree depth first (``longstraw_agents.segmenter``). Every mode evaluates its
loss through ``NodeLoss`` (naive: a member's whole sequence is one node) and returns ``WalkMetrics``, whose sums stay
on the device until ``backward_group`` reduces them.

Detached mode can keep the context it captured for the next optimizer steps on the same groups (``PrefixCache``,
``GRPOConfig.capture_reuse`` with ``num_iterations`` > 1): exact in the first step, approximate after it, since
the context's states then come from older weights. Measured by bench/capture_reuse.py (random-init llama, hidden
256 x 4 layers, a 2,048-token prompt, G = 8 completions of 64 tokens, AdamW lr 1e-5, CPU, bench/results/
capture_reuse.json): against recapturing at the same weights, the gradient drifts by 1.4 % of its norm per
optimizer step since the capture (1.4, 2.7, 4.1 % at steps 1-3; cosine >= 0.9991) and the loss by 8e-4 per step
(about a tenth of how far the loss itself moved per step); ten times less at lr 1e-6. Steps 1-3 ran 1.6x faster
(2.5-3.7x with an 8,192-token prompt; timed on a shared 2-core machine, so only roughly). For scale, detached
mode's own gradient is 78 % (relative L2) away from the exact one on that model, at every step.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
import torch
from torch import Tensor

from longstraw_agents.engine import ChunkLoss, Engine
from longstraw_agents.segmenter import Node, PrefixTree, fuse_chains, nodes_with_loss_below
from longstraw_agents.state import State, StateGrad
from longstraw_agents.trainer.group import Group
from longstraw_agents.trainer.head import Head
from longstraw_agents.trainer.loss import GRPOLoss, LossConfig
from longstraw_agents.trainer.metrics import LossSums, WalkMetrics
from longstraw_agents.trainer.node_loss import NodeLoss, member_node

ModeName = Literal["naive", "detached", "exact"]


class PrefixCache:
    """One group's context states, captured in the first of several optimizer steps on it and reused by the next
    ones (detached mode; ``GRPOConfig.capture_reuse``).

    The first walk extends every interior node as usual and keeps its state (and the reference model's); later walks
    replay the loss segments from the kept states and extend nothing. The policy's states then come from the
    weights of the first walk, so later gradients are approximate; the reference's stay exact (its weights never
    change). It holds every interior state of the tree, not only those on the active path, until it is dropped.
    """

    def __init__(self) -> None:
        self.tree: PrefixTree | None = None
        self._states: dict[int, tuple[State, State | None]] = {}

    def __len__(self) -> int:
        return len(self._states)

    def bind(self, tree: PrefixTree) -> None:
        """Tie the cache to ``tree`` (node identities are its keys, and the tree keeps the nodes alive)."""
        if self.tree is None:
            self.tree = tree
        elif self.tree is not tree:
            raise ValueError("a PrefixCache holds the states of one group's tree; use one cache per group")

    def get(self, node: Node) -> tuple[State, State | None] | None:
        return self._states.get(id(node))

    def put(self, node: Node, state: State, ref_state: State | None) -> None:
        self._states[id(node)] = (state, ref_state)


class ExecutionMode(ABC):
    """How one group's loss is evaluated and backpropagated; ``run`` walks one group (a mode is used once).

    prefix_cache: context states to reuse across optimizer steps (only modes with ``reuses_prefix``)."""

    name: ClassVar[ModeName]
    reuses_prefix: ClassVar[bool] = False

    def __init__(
        self,
        engine: Engine,
        config: LossConfig,
        ref_engine: Engine | None = None,
        prefix_cache: PrefixCache | None = None,
    ):
        if prefix_cache is not None and not self.reuses_prefix:
            raise ValueError(
                f"{self.name} mode cannot reuse a captured prefix (capture_reuse is for detached mode: exact mode "
                "backpropagates through the context, so it must recompute it with the current weights)"
            )
        self.prefix_cache = prefix_cache
        self.engine = engine
        self.config = config
        self.objective = GRPOLoss.from_config(config)
        self.head = Head.of(engine)
        self.ref_engine = ref_engine if config.beta > 0 else None
        if config.beta > 0 and ref_engine is None:
            raise ValueError("beta > 0 needs a reference model (ref_model=...)")
        self.ref_head = Head.of(ref_engine) if self.ref_engine is not None and ref_engine is not None else None

    def run(self, group: Group) -> WalkMetrics:
        """Accumulate the group's gradient into ``param.grad``; the loss sums and counts of the walk."""
        self.group = group
        self.sums = LossSums.zeros(self.engine.adapter.device)
        self.nodes = self.forward_tokens = 0
        self.walk(group)
        return WalkMetrics(sums=self.sums, nodes=self.nodes, forward_tokens=self.forward_tokens)

    @abstractmethod
    def walk(self, group: Group) -> None: ...

    def node_loss(self, node: Node, inputs: Tensor, ref_state: State | None) -> NodeLoss:
        """The node's loss; with a KL term, the reference log-probs come from ``ref_state`` + ``inputs``."""
        ref_logp = None
        if self.ref_engine is not None and self.ref_head is not None and ref_state is not None and inputs.numel():
            targets = torch.as_tensor(node.targets, dtype=torch.long, device=inputs.device)
            with torch.no_grad():
                ref_hidden = self.ref_engine.hidden(ref_state, inputs)
                ref_logp = self.ref_head.logprobs(ref_hidden, targets, self.config.temperature)
        return NodeLoss(self.group, node, self.objective, self.head, inputs.device, ref_logp)

    def evaluate(self, loss: NodeLoss, hidden: Tensor, lo: int, hi: int) -> Tensor:
        """The loss of rows ``[lo, hi)`` of a node from their hidden states; its sums are added to the walk's."""
        value, sums = loss(hidden, lo, hi)
        self.sums = self.sums + sums
        return value

    def _ids(self, array: np.ndarray) -> Tensor:
        return torch.as_tensor(array, dtype=torch.long, device=self.engine.adapter.device)


class NaiveMode(ExecutionMode):
    """One full graph per member over its whole sequence, all G alive until one backward (the reference, and how
    a conventional trainer batches a group)."""

    name = "naive"

    def walk(self, group: Group) -> None:
        total = None
        for k, member in enumerate(group.members):
            node = member_node(member, k)
            if not node.has_loss:
                continue
            inputs = self._ids(node.input_ids)
            ref_state = self.ref_engine.empty_state() if self.ref_engine is not None else None
            loss = self.node_loss(node, inputs, ref_state)
            hidden = self.engine.hidden(self.engine.empty_state(), inputs)
            self.forward_tokens += inputs.numel()
            value = self.evaluate(loss, hidden, 0, inputs.numel())
            total = value if total is None else total + value
            self.nodes += 1
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
    keeps_graphs = False  # exact mode: capture chunks may keep their graphs (EngineConfig.graph_budget_bytes)

    def tree(self, group: Group) -> PrefixTree:
        return group.tree

    def walk(self, group: Group) -> None:
        self.grad = self.engine.new_grad()
        self.bank = self.engine.graph_bank(self.grad) if self.keeps_graphs else None
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
        self.nodes += 1
        inputs = self._ids(node.input_ids)
        loss = self.node_loss(node, inputs, ref_parent) if node.has_loss else None
        if not any(id(c) in self.live for c in node.children):
            if loss is not None and inputs.numel():
                self.leaf(node, inputs, parent, loss)
            return None
        if not inputs.numel():  # the virtual root of a group without a shared first token
            return _Pending(node, inputs, parent, parent, ref_parent, None)
        state, ref_state = self.extend(node, inputs, parent, ref_parent)
        return _Pending(node, inputs, parent, state, ref_state, loss)

    def extend(self, node: Node, inputs: Tensor, parent: State, ref_parent: State | None) -> tuple[State, State | None]:
        """The states of the policy and the reference after an interior node's inputs (no graph)."""
        reserve = self.reserve.get(id(node), 0)
        state = self.engine.extend(parent, inputs, reserve=reserve, keep=self.bank)
        self.forward_tokens += inputs.numel()
        ref_state = ref_parent
        if self.ref_engine is not None and ref_parent is not None:
            ref_state = self.ref_engine.extend(ref_parent, inputs, reserve=reserve)
        return state, ref_state

    def _loss_fn(self, loss: NodeLoss, base: int) -> ChunkLoss:
        def chunk_loss(hidden: Tensor, start: int, end: int) -> Tensor:
            return self.evaluate(loss, hidden, start - base, end - base)

        return chunk_loss

    def is_long(self, inputs: Tensor) -> bool:
        """A loss node longer than a chunk is walked chunk by chunk like the prefix (never one [n] graph)."""
        return inputs.numel() > self.engine.config.chunk_size

    def chunked_backward(
        self, inputs: Tensor, parent: State, loss: NodeLoss, grad: StateGrad, into_parent: bool
    ) -> None:
        """A long loss node: captured without a graph (with recurrent checkpoints), then its chunks recomputed in
        reverse, each with its loss; ``into_parent``: also pass the gradient on to ``parent``'s state."""
        state = self.engine.extend(parent.with_checkpoints(self.engine.checkpoint_spacing), inputs)
        before, self.sums = self.sums, LossSums.zeros(self.engine.adapter.device)  # the node's own sums, from zero
        loss_fn = self._loss_fn(loss, parent.num_tokens)
        walk = self.engine.backward(state, grad, inputs, since=parent, loss_fn=loss_fn, into_since=into_parent)
        self.sums = before + self.sums.mapped(walk.total)  # the whole node's, whichever rank evaluated which chunks
        self.forward_tokens += 2 * inputs.numel()

    @abstractmethod
    def leaf(self, node: Node, inputs: Tensor, parent: State, loss: NodeLoss) -> None: ...

    @abstractmethod
    def interior(self, node: Node, inputs: Tensor, parent: State, state: State, loss: NodeLoss | None) -> None:
        """Called after all children are done (post-order)."""


class DetachedMode(TreeMode):
    """Loss segments replayed from a constant state: gradients never reach the context (the seed's behaviour).
    With a ``PrefixCache`` the context states of an earlier walk of the same group are reused."""

    name = "detached"
    reuses_prefix = True

    def walk(self, group: Group) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.bind(group.tree)
        super().walk(group)

    def extend(self, node: Node, inputs: Tensor, parent: State, ref_parent: State | None) -> tuple[State, State | None]:
        if self.prefix_cache is None:
            return super().extend(node, inputs, parent, ref_parent)
        cached = self.prefix_cache.get(node)
        if cached is None:
            cached = super().extend(node, inputs, parent, ref_parent)
            self.prefix_cache.put(node, *cached)
        return cached

    def leaf(self, node: Node, inputs: Tensor, parent: State, loss: NodeLoss) -> None:
        self._replay(inputs, parent, loss)

    def interior(self, node: Node, inputs: Tensor, parent: State, state: State, loss: NodeLoss | None) -> None:
        if loss is not None:
            self._replay(inputs, parent, loss)

    def _replay(self, inputs: Tensor, parent: State, loss: NodeLoss) -> None:
        if self.is_long(inputs):  # the node's own chunks are differentiable, the parent's state is not
            self.chunked_backward(inputs, parent, loss, self.engine.new_grad(), into_parent=False)
            return
        hidden = self.engine.hidden(parent, inputs)
        self.forward_tokens += inputs.numel()
        self.evaluate(loss, hidden, 0, inputs.numel()).backward()


class ExactMode(TreeMode):
    """Branch gradients w.r.t. the state are accumulated, then pushed through the context chunk by chunk."""

    name = "exact"
    checkpoints = True
    keeps_graphs = True

    def tree(self, group: Group) -> PrefixTree:
        # every interior node is extended and recomputed in chunks whether or not it has loss, so runs of short
        # turns fuse without changing the gradient; long context stays apart (no LM head over it in backward)
        return fuse_chains(group.tree, max_context=self.engine.config.chunk_size)

    def leaf(self, node: Node, inputs: Tensor, parent: State, loss: NodeLoss) -> None:
        if self.is_long(inputs):
            self.chunked_backward(inputs, parent, loss, self.grad, into_parent=True)
            return
        hidden = self.engine.hidden(parent, inputs, grad=self.grad)
        self.forward_tokens += inputs.numel()
        self.evaluate(loss, hidden, 0, inputs.numel()).backward()

    def interior(self, node: Node, inputs: Tensor, parent: State, state: State, loss: NodeLoss | None) -> None:
        loss_fn = self._loss_fn(loss, parent.num_tokens) if loss is not None else None
        kept = sum(c.length for c in state.chunks if c.start >= parent.num_tokens and self.bank and c in self.bank)
        before, self.sums = self.sums, LossSums.zeros(self.engine.adapter.device)  # the node's own sums, from zero
        walk = self.engine.backward(state, self.grad, inputs, since=parent, loss_fn=loss_fn, kept=self.bank)
        self.sums = before + self.sums.mapped(walk.total)  # the whole node's, whichever rank evaluated which chunks
        self.forward_tokens += inputs.numel() - kept  # the chunks recomputed (kept graphs are not)


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
