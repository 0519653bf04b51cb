"""A GRPO step's phases on the slowest rank (``step_work``): the work the engine's schedule does in each —
rollout, scoring, capture, replay, exact mode's walk, the optimizer — counted by ``Schedule`` from the model's work
(``work.ModelWork``) and the cuts, waves and gathers the engine runs (``cut_runs``, ``capture_waves``,
``walk_gather_order``), with the communication of context parallelism, FSDP2 and expert parallelism.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from longstraw_agents.engine import capture_waves, checkpoint_spacing, layer_inputs_spacing
from longstraw_agents.engine.schedule import chunk_runs, cut_runs, walk_gather_order, waves
from longstraw_agents.plan.configs import load_config
from longstraw_agents.plan.request import PlanRequest
from longstraw_agents.plan.work import ModelWork, Work, total


@dataclass(frozen=True)
class StepWork:
    """The work of a GRPO step's phases on the slowest rank (the last cp rank: the longest attention reach), and the
    request it was counted for."""

    request: PlanRequest
    phases: dict[str, Work]


def step_work(request: PlanRequest, model: ModelWork | None = None, rollout: bool = True) -> StepWork:
    """Phases of one group's step (``request``): ``rollout`` (decoding in process, when asked), ``scoring`` (the
    reference model's log-probs when ``beta > 0``), ``capture``, ``replay`` (each member's branch forward and
    backward), in exact mode ``walk`` (the reverse walk over the prefix), and with an optimizer ``optimizer`` (its
    step over the rank's shard, once per optimizer step)."""
    model = model or ModelWork.of(load_config(request.model), request.dtype, request.lora)
    schedule = Schedule(request, model, sharded=request.sharded)
    phases = {"rollout": schedule.rollout()} if rollout else {}
    if request.beta > 0:
        phases["scoring"] = schedule.scoring()
    phases["capture"] = schedule.capture()
    phases["replay"] = schedule.replay()
    if request.mode == "exact":
        phases["walk"] = schedule.walk()
    if request.optimizer != "none":
        phases["optimizer"] = schedule.optimizer()
    return StepWork(request, phases)


@dataclass(frozen=True)
class CaptureShare:
    """A cp rank's part of a sharded capture: the work of its chunks (every layer's matmuls on its positions,
    attention to every position before them), its positions (the state it stores) and the other ranks' positions
    before its runs (their rows, received at every growing layer)."""

    work: Work = field(default_factory=Work)
    positions: int = 0
    received: int = 0


@dataclass(frozen=True)
class Schedule:
    """How the engine spreads a step over the ranks (docs/distributed.md): the capture and the walk are sharded
    (each cp rank its runs of the prompt, cut as ``cut_runs`` cuts it — balanced, or in rank order where exact
    mode's wavefront walk reads the capture's layer inputs — the other ranks' rows before them received per layer;
    the slowest rank's work counted), a member's short
    extends are replicated (every rank computes each member's tokens, attending to the positions it holds, the
    partial results merged; the member's own positions spread over the ranks — counted here with the last rank's
    shard, a completion being short next to the prompt; an agent's long ``history`` is not modelled); under a
    kept-graph budget or expert parallelism the capture and the walk are replicated too, chunk by chunk (each rank
    attending to the positions it holds), and under expert parallelism each rank computes its own experts' share of
    the routed work (``ModelWork.experts``) and all-reduces their outputs per MoE call;
    FSDP2 gathers a layer per pass (at dp > 1 each dp rank for itself) and reduces its gradient in the master dtype
    (``sharded``; False: every rank holds the whole model, and exact mode sums the parameter gradient over cp)."""

    request: PlanRequest
    model: ModelWork
    sharded: bool = True

    def __post_init__(self) -> None:
        if self.request.expert_parallel and self.model.experts == 1.0:  # each rank its own experts' share
            object.__setattr__(self, "model", replace(self.model, experts=1.0 / self.cp))

    @property
    def cp(self) -> int:
        return self.request.context_parallel

    @property
    def ranks(self) -> int:
        """The ranks a parameter is sharded over (all, or with HSDP one dp rank's cp ranks)."""
        return self.request.shard_ranks

    @property
    def captured(self) -> int:
        """The positions the capture evaluates: the prompt's last token starts every branch (its logits score the
        first completion token)."""
        return self.request.context - 1

    @property
    def shard(self) -> int:
        return -(-self.captured // self.cp)

    @property
    def first(self) -> int:
        """The first captured position of the last cp rank."""
        return min((self.cp - 1) * self.shard, self.captured)

    def _gathers(
        self, passes: float, root: bool = False, frozen: bool = False, expert_passes: float | None = None
    ) -> Work:
        """FSDP2's all-gathers of ``passes`` passes over the decoder layers, a layer at a time, and with ``root`` the
        root unit's once (whole for a block: the step, a rollout). At dp > 1 without HSDP each dp rank gathers for
        itself (``parallel.lanes``): a rank receives its own dp rank's gathers and sends its shard to every dp rank's,
        the bytes of one gather over every rank when the dp ranks gather alike. ``frozen``: the KL reference's, whose
        shards are kept in the compute dtype (no master weights: an offloaded gather copies those in). Under expert
        parallelism each pass also copies offloaded experts in (``expert_passes`` times, where they differ)."""
        if self.ranks == 1 or not self.sharded:
            return Work()
        itemsize = self.model.dtype.itemsize if frozen else self.request.master_itemsize
        nbytes = passes * self._gathered_layer_bytes + (self.model.root_bytes if root else 0.0)
        experts = passes if expert_passes is None else expert_passes
        return self._moved(nbytes, itemsize) + self._experts_in(experts, itemsize)

    @property
    def _gathered_layer_bytes(self) -> float:
        """What a gather of a decoder layer moves: the whole layer, or without its routed experts (expert
        parallelism: each rank computes its own, never gathered)."""
        experts = self.model.routed.weight_bytes if self.request.expert_parallel else 0.0
        return self.model.layer_bytes - experts

    def _experts_in(self, passes: float, shard_itemsize: int) -> Work:
        """Expert parallelism with offloaded shards: each pass copies the rank's experts in (each MoE call)."""
        if not self.request.expert_parallel:
            return Work()
        return self._host_copy(passes * self.model.routed.weight_bytes / self.model.dtype.itemsize * shard_itemsize)

    def _layer_reductions(self) -> Work:
        """A backward pass's reductions of the decoder layers' gradient; under expert parallelism the routed
        experts' gradient goes into the rank's shards where it is (to the host where they are offloaded)."""
        layers = self.model.gradient_bytes - self.model.root_gradient_bytes  # (a LoRA policy: its adapters')
        if not self.request.expert_parallel or self.model.trained_bytes is not None:  # (LoRA: the experts frozen)
            return self._reduced(layers)
        experts = self.model.routed.weight_bytes / self.model.dtype.itemsize * self.request.master_itemsize
        return self._reduced(self._gathered_layer_bytes) + self._host_copy(experts)

    def _reduced(self, nbytes: float) -> Work:
        """A reduce-scatter of the gradient of ``nbytes`` of weights: in the master dtype (FSDP2's ``reduce_dtype``
        under mixed precision), its shard copied out where the shards are offloaded."""
        if not self.sharded or self.ranks == 1:
            return Work()
        master = nbytes / self.model.dtype.itemsize * self.request.master_itemsize
        return Work(comm=master * (self.ranks - 1) / self.ranks) + self._host_copy(master)

    def _moved(self, nbytes: float, shard_itemsize: int) -> Work:
        """An all-gather of ``nbytes`` of weights (in the compute dtype) over the shard ranks, and where the shards
        are offloaded (FSDP2's CPU offload) the rank's shard of them — ``shard_itemsize`` bytes per parameter —
        copied in first."""
        if not self.sharded or self.ranks == 1:
            return Work()
        shards = nbytes / self.model.dtype.itemsize * shard_itemsize
        return Work(comm=nbytes * (self.ranks - 1) / self.ranks) + self._host_copy(shards)

    @property
    def _offloaded(self) -> bool:
        """Whether the shards live on the host (FSDP2's CPU offload shards over 2 ranks or more)."""
        return self.request.offload and self.sharded and self.ranks > 1

    def _host_copy(self, nbytes: float) -> Work:
        """With ``offload``, the rank's shard of ``nbytes`` (as the shards hold them) over the host link."""
        return Work(host=nbytes / self.ranks) if self._offloaded else Work()

    def _held(self, work: Work) -> Work:
        """A replicated extend's ``work`` (every rank computing every token) on one rank: attention (and DSA's
        scores and selected rows) to the positions the rank holds, 1/cp of them."""
        share = 1.0 / self.cp
        return replace(
            work,
            attention=work.attention * share,
            attention_backward=work.attention_backward * share,
            selection=work.selection * share,
            gathered=work.gathered * share,
        )

    def _expert_sums(
        self, tokens: int, forwards: float = 1.0, backwards: float = 0.0, entries_only: bool = False
    ) -> Work:
        """Expert parallelism's all-reduces over the cp ranks, per MoE call on ``tokens`` replicated tokens: the
        experts' shares of the output in ``forwards``, the gradients of the tokens and of their routing weights
        (at least fp32) in ``backwards`` (a ring all-reduce moves ``2 (cp - 1) / cp`` of the bytes each way)."""
        if not self.request.expert_parallel:
            return Work()
        config, itemsize = self.model.config, self.model.dtype.itemsize
        outputs = tokens * config.hidden_size * itemsize
        weights = tokens * config.num_experts_per_tok * max(4, itemsize)
        ring = 2 * (self.cp - 1) / self.cp * self.model.routed.calls(entries_only)
        return Work(comm=ring * (forwards * outputs + backwards * (outputs + weights)))

    def _merges(self, tokens: int) -> Work:
        """The partial attention results of ``tokens`` replicated positions, all-gathered over the cp ranks."""
        if self.cp == 1:
            return Work()
        row = self.model.config.hidden_size * self.model.dtype.itemsize
        return Work(comm=tokens * row * self.model.attention_layers() * (self.cp - 1))

    def _extend(self, tokens: int) -> Work:
        """One member's own tokens after the prompt, on a rank: every token's matmuls, attention to the positions
        the rank holds (counted as its shard and the member's own positions, which in fact spread over the ranks)."""
        work = self.model.forward(tokens, self.captured - self.first)
        work = replace(work, launches=0.0, branch_calls=work.launches)
        return work + self._merges(tokens) + self._expert_sums(tokens)

    def rank_captures(self, balanced: bool, model: ModelWork | None = None) -> list[CaptureShare]:
        """Each cp rank's part of the prompt's sharded capture, cut as the engine cuts it (``cut_runs``: balanced,
        or in rank order where the capture keeps layer inputs for the wavefront walk); ``model``: counted with
        another share of the routed work."""
        chunk, ranks = self.request.engine.chunk_size, [CaptureShare() for _ in range(self.cp)]
        model = model or self.model
        for lo, hi, owner in cut_runs(self.captured, self.cp, balanced):
            mine = ranks[owner]
            ranks[owner] = CaptureShare(
                mine.work + model.chunked(lo, hi, chunk, entries_only=True),
                mine.positions + hi - lo,
                mine.received + lo - mine.positions,  # the others' positions before the run, received per layer
            )
        return ranks

    def capture_balance(self, balanced: bool) -> tuple[float, float]:
        """The sharded capture's max / mean over the cp ranks of their work (FLOPs) and of the state they store."""
        ranks = self.rank_captures(balanced)
        work = [r.work.flops for r in ranks]
        state = [self.model.entries_bytes(r.positions) for r in ranks]
        return max(work) / (sum(work) / len(work)), max(state) / (sum(state) / len(state))

    def capture(self) -> Work:
        """The prompt's capture (no gradient): sharded over the cp ranks — each its own chunks, a layer at a time
        across them, every layer gathered once per wave of runs (twice balanced: ``capture_waves``) and the others'
        rows before each of its runs received (the slowest rank's: ``rank_captures``) — or chunk by chunk (one cp
        rank; replicated under a kept-graph budget or expert parallelism: every rank computes every chunk, attending
        to the positions it holds, the partials merged), each chunk gathering every layer (``LayerGather.run``)."""
        request = self.request
        chunk = request.engine.chunk_size
        if not request.sharded_extends:  # (under expert parallelism unless dispatched: ``_dispatches``)
            chunks = self._held(self.model.chunked(0, self.captured, chunk, entries_only=True))
            replicated = self._merges(self.captured) + self._expert_sums(self.captured, entries_only=True)
            return chunks + replicated + self._gathers(self._chunks, root=True)
        # (dispatched: a rank's experts serve every rank's tokens, as much routed work as its own at full share)
        model = replace(self.model, experts=1.0) if request.dispatched else None
        slowest = max(self.rank_captures(request.balanced_context, model), key=lambda share: share.work.flops)
        rows = Work(comm=self.model.entries_bytes(slowest.received))
        runs = cut_runs(self.captured, self.cp, request.balanced_context)
        gathered = capture_waves([owner for _, _, owner in runs])
        if not request.dispatched:
            return slowest.work + rows + self._gathers(gathered, root=True)
        # each peer's part of a round copies the rank's (offloaded) experts of its layer in: at most a copy of them
        # all per chunk of the prompt, as a replicated capture makes
        gathers = self._gathers(gathered, root=True, expert_passes=self._chunks)
        return self._lockstep(runs, model or self.model) + rows + self._dispatches(slowest.positions) + gathers

    def _lockstep(self, runs: Sequence[tuple[int, int, int]], model: ModelWork) -> Work:
        """A sharded capture whose ranks meet at every wavefront step (expert parallelism's rounds: a rank waits for
        the busiest): per step, the work of the rank with the most, a cell being its run's work over the layers."""
        chunk, layers = self.request.engine.chunk_size, self.model.config.num_hidden_layers
        cells = [model.chunked(lo, hi, chunk, entries_only=True).scaled(1 / layers) for lo, hi, _ in runs]
        steps = []
        for step in range(len(runs) + layers - 1):
            ranks: dict[int, Work] = {}
            for k, (_, _, owner) in enumerate(runs):
                if 0 <= step - k < layers:
                    ranks[owner] = ranks.get(owner, Work()) + cells[k]
            steps.append(max(ranks.values(), key=lambda work: work.flops))
        return total(steps)

    def _dispatches(self, tokens: int) -> Work:
        """Expert parallelism's rounds in a sharded extend, for a rank's ``tokens``: per MoE call each token's row
        sent to each of its ``top_k`` experts and the output back, (cp - 1) / cp of them to other ranks (routing
        assumed even)."""
        config, itemsize = self.model.config, self.model.dtype.itemsize
        rows = tokens * config.num_experts_per_tok * config.hidden_size * itemsize
        return Work(comm=2 * rows * (self.cp - 1) / self.cp * self.model.routed.calls(entries_only=True))

    @property
    def _chunks(self) -> int:
        """The prompt's chunks."""
        return -(-self.captured // self.request.engine.chunk_size)

    def scoring(self) -> Work:
        completion = self.request.completion
        member = self._extend(completion) + self.model.head(completion)
        return member.scaled(self.request.group) + self._gathers(self.request.group, frozen=True)

    def replay(self) -> Work:
        """Each member's branch forward and backward (its layers once more with activation checkpointing); the
        LM head's tiles are recomputed in backward (four head products in all)."""
        request = self.request
        forward = self._extend(request.completion)
        forwards = 2.0 if request.engine.activation_checkpointing else 1.0
        head = self.model.head(request.completion).scaled(self.model.head_products)
        member = forward.scaled(forwards) + forward.backward(self.model.backward_products) + head
        member = member + self._merges(request.completion).scaled(2.0)  # the queries' gradient, all-reduced
        member = member + self._expert_sums(request.completion, forwards=0.0, backwards=1.0)
        member = member + self.model.routed_recompute(request.completion)
        per_member_gathers = self._gathers(2)
        step = Work()
        if self.sharded and self.ranks > 1:
            # each layer's gradient reduced as its backward ends; the root's (whole for the step) at the end
            per_member_gathers = per_member_gathers + self._layer_reductions()
            step = self._reduced(self.model.root_gradient_bytes)
        if self.sharded and self.request.hsdp and request.data_parallel > 1:  # the replicas' gradient shards summed
            dp = request.data_parallel
            step = step + Work(comm=2 * (dp - 1) / dp * self.model.gradient_bytes / self.ranks)
        return (member + per_member_gathers).scaled(request.group) + step

    def walk(self) -> Work:
        """Exact mode's reverse walk: the rank's chunks recomputed under autograd and backpropagated (the wavefront
        walk on its busiest rank, a layer at a time: each layer gathered for its recomputation and per wave of runs
        for its backward, its gradient reduced per wave), or chunk by chunk (one rank, or the replicated walk: every
        chunk of the prompt on every rank), where every chunk's forward gathers each layer, its backward gathers it
        again and reduces its gradient (``LayerGather.run``, as a branch does)."""
        request = self.request
        chunk = request.engine.chunk_size
        wavefront = request.wavefront
        if wavefront:
            recompute, backward, received = self._walked_rank()
            # the layers gathered as the engine gathers them (``walk_gather_order``: paced over both waves of a
            # balanced cut, or segment by segment), each layer's gradient reduced per wave of runs
            runs = chunk_runs(2 * self.cp, self.cp, request.balanced_context)
            layers, every = self.model.layers, layer_inputs_spacing(self.model.layers, request.engine)
            passes = len(walk_gather_order(runs, layers, every, paced=request.paced_walk)) / layers
            weights = self._gathers(passes) + self._layer_reductions().scaled(len(waves(runs)))
        else:
            recompute = self.model.chunked(0, self.captured, chunk)  # every layer whole (its hidden states too)
            backward = self.model.chunked(0, self.captured, chunk, entries_only=True).backward(
                self.model.backward_products
            )  # what feeds the state
            backward = backward + self.model.routed_recompute(self.captured, entries_only=True)
            received = self.first  # (the state gradient broadcast from its owners, as counted before the last rank)
            weights = (self._gathers(2) + self._layer_reductions()).scaled(self._chunks)
        state_gradient = Work(comm=self.model.state_bytes(received) * max(1.0, 4 / self.model.dtype.itemsize))
        merged = Work()  # a replicated walk's collectives over the cp ranks
        if not wavefront:  # (the recurrent states between checkpoints: each recomputed chunk gathers every layer)
            recompute = recompute + self._recurrent_segments()
            weights = weights + self._gathers(self._recomputed_chunks())
            if self.cp > 1:  # replicated: attention to the rank's positions, partials merged, queries' gradient summed
                recompute, backward = self._held(recompute), self._held(backward)
                recomputed = self._recomputed_chunks() * chunk
                merged = self._merges(self.captured).scaled(2.0) + self._expert_sums(self.captured + recomputed)
                merged = merged + self._expert_sums(self.captured, forwards=0.0, backwards=1.0, entries_only=True)
        if self.cp > 1 and not (self.sharded and self.ranks > 1):  # the walk's gradient all-reduced over cp, fp32
            gradient = self.model.gradient_bytes / self.model.dtype.itemsize
            weights = Work(comm=gradient * 4 * 2 * (self.cp - 1) / self.cp)
        return recompute + backward + state_gradient + merged + weights

    def _walked_rank(self) -> tuple[Work, Work, int]:
        """Exact mode's wavefront walk on the busiest cp rank: its runs of the prompt (cut as its capture was,
        ``cut_runs``) recomputed under autograd, every layer whole, and backpropagated, and the other ranks'
        positions before its runs, whose rows' gradient it sends back."""
        chunk, busiest = self.request.engine.chunk_size, (Work(), Work(), 0)
        cut = cut_runs(self.captured, self.cp, self.request.balanced_context)
        for rank in range(self.cp):
            mine = [(lo, hi) for lo, hi, owner in cut if owner == rank]
            recompute = total(self.model.chunked(lo, hi, chunk) for lo, hi in mine)
            backward = total(self.model.chunked(lo, hi, chunk, entries_only=True) for lo, hi in mine).backward(
                self.model.backward_products
            )
            backward = backward + self.model.routed_recompute(sum(hi - lo for lo, hi in mine), entries_only=True)
            held, received = 0, 0
            for lo, hi in mine:
                received, held = received + lo - held, held + hi - lo
            if (recompute + backward).flops > (busiest[0] + busiest[1]).flops:
                busiest = (recompute, backward, received)
        return busiest

    def optimizer(self) -> Work:
        """AdamW's step over the rank's shard of the parameters (all of them unsharded): each parameter, its
        gradient and its two moments read and three of them written, in the master dtype — device memory, or with
        ``offload`` host memory (FSDP2's CPU offload steps there)."""
        parameters = self.model.gradient_bytes / self.model.dtype.itemsize  # (those that train)
        if self.sharded:
            parameters /= self.ranks
        nbytes = 7 * parameters * self.request.master_itemsize
        return Work(host_step=nbytes) if self._offloaded else Work(memory=nbytes)

    def _recurrent_segments(self) -> Work:
        """The recurrent states the walk needs between checkpoints (kept after every k-th chunk and the last one),
        recomputed forward without a graph, each chunk once: the chunks' state entries, but the kept ones'."""
        chunk = self.request.engine.chunk_size
        kept = self._kept_checkpoints()
        if kept is None:
            return Work()
        segments = self.model.chunked(0, (self._chunks - 1) * chunk, chunk, entries_only=True)
        return segments + total(self.model.forward(chunk, m * chunk, entries_only=True) for m in kept).scaled(-1.0)

    def _recomputed_chunks(self) -> int:
        """How many chunks ``_recurrent_segments`` recomputes."""
        kept = self._kept_checkpoints()
        return 0 if kept is None else self._chunks - 1 - len(kept)

    def _kept_checkpoints(self) -> list[int] | None:
        """The chunks after which the capture kept the recurrent states (None: after every one, or one chunk)."""
        every = checkpoint_spacing(self.model.config, self.model.dtype, self.request.engine)
        if every == 1 or self._chunks < 2:
            return None
        return [m for m in range(self._chunks - 1) if (m + 1) % every == 0]

    def rollout(self) -> Work:
        """Decoding ``completion`` tokens for every member in one batch, the cp ranks together (``parallel.sampling``):
        each rank reads the prompt's and the members' positions it holds (1/cp of them), every decode step's attention
        partials merged over the ranks; with FSDP2's gathers: each decode step's layers, a layer at a time, and the root
        unit once (each copied from the host first where the shards are offloaded)."""
        request, model = self.request, self.model
        group, prompt, cp = request.group, self.captured, self.cp
        weights = model.decoded_weight_bytes(group)
        shared, head = model.state_bytes(prompt, cp), model.head(1).matmul
        steps = []
        for t in range(request.completion):
            token = model.forward(1, -(-(prompt + t) // cp))  # (decoded tokens spread over the ranks too)
            steps.append(
                Work(
                    matmul=(token.matmul + head) * group,
                    attention=token.attention * group,
                    recurrent=token.recurrent * group,
                    selection=token.selection * group,
                    elementwise=token.elementwise * group,
                    memory=weights + shared + group * model.state_bytes(t, cp),
                    gathered=token.gathered * group,
                    decode_calls=token.launches,
                )
            )
        merges = (self._merges(group) + self._expert_sums(group)).scaled(request.completion)
        gathers = self._gathers(request.completion, root=True)
        return total(steps) + merges + gathers
