"""The time model: how long a GRPO step takes, from the work its schedule does and a hardware profile
(``longstraw plan --time``).

The work of each phase is counted for one rank from the model's config and the schedule the engine runs, by class:

- ``matmul``: FLOPs of the weight matmuls — two per weight a token multiplies (a mixture of experts' routed share
  only: ``FamilyAdapter.active_fraction``), the LM head where log-probs are taken;
- ``attention`` (and ``attention_backward``): softmax attention's (query, key) pairs as the fused kernels compute
  them (the masked half of a chunk's diagonal block skipped; DSA's top-k rows: ``FamilyAdapter.layer_work``);
- ``recurrent`` (and ``recurrent_backward``): GatedDeltaNet's chunked delta rule;
- ``selection``: DSA's index scores, each with its share of the top-k (no gradient);
- ``elementwise``: the elements the matmuls write, which the norms, rotations, activations, residuals and merges
  around them go over;
- ``gathered``: bytes gathered row by row (DSA's selected rows), scattered back in backward;
- ``memory``: bytes a memory-bound phase reads (decoding: the weights once per step for the whole batch, the shared
  prefix's state once per step per group, each member's own rows);
- ``launches``, ``branch_calls``, ``decode_calls``: layer calls (and sequential steps inside a layer) of a chunk, of
  a branch (an extend under autograd's bookkeeping) and of a batched decoding step — each a few dozen kernels whose
  host-side cost no FLOP count shows, different on each path;
- ``comm``: bytes the rank sends and receives: the capture's rows from earlier cp ranks, the partial attention
  merged over cp ranks in replicated extends, exact mode's state gradient going back, FSDP's gathers and
  reduce-scatters;
- ``host``: bytes between host and device where the shards are offloaded (each gather's shards in, each
  reduction's gradient shard out), and ``host_step``: the bytes AdamW's step goes over there (on the device its
  step is ``memory``): the ``optimizer`` phase, once per optimizer step.

A backward pass costs twice its forward in matmuls, the delta rule and elementwise work and 2.5 times in attention
(the fused backward recomputes the scores: five products to the forward's two); activation checkpointing adds one
forward. A LoRA policy (``PlanRequest.lora``) adds its adapters' matmuls, and a frozen weight's backward is one
product (its input's gradient), not two (``ModelWork.backward_products``); gradients are reduced and AdamW steps for
the adapters alone. (Autograd skips the input gradient of the first layer's input projections too, the embeddings
being frozen: not counted, a share of about 1 / (3 x layers) of a layer's matmuls.) Attention's and the delta rule's
backward are classes of their own, each at its own rate (their kernels are not their forwards').

``HardwareProfile`` turns work into seconds: each class at its own achieved rate (peak x efficiency) plus the host's
latency per layer call on each path, summed (no overlap: an upper estimate where communication hides behind
compute, or the host behind the device). ``bench/ceilings.py`` measures a profile op by op (a layer-shaped matmul,
the attention kernels, the delta rule, DSA's top-k, a matrix-vector product, layer calls at a negligible width) and
``bench/timing.py`` checks it against every phase measured on the same machine, none fitted; ``calibrate`` instead
fits a profile to measured phases. The H200's profile has its matmul and copy rates from measurements on one and
typical attention fractions; H100 and H20 take the same fractions at their own peaks — a model output, labelled
as such.

    time = step_time(PlanRequest(model="qwen3.6-27b", context=2_100_000, gpus=8), PROFILES["h20"])
    print(time.table())
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor
from transformers import PretrainedConfig

from longstraw_agents.engine import capture_waves, checkpoint_spacing
from longstraw_agents.models import adapter_class, state_size
from longstraw_agents.models.base import LayerWork
from longstraw_agents.models.lora import LoraSpec, lora_layers, transformers_name
from longstraw_agents.parallel.context import cut_runs
from longstraw_agents.planner import PlanRequest, load_config, meta_model

BACKWARD = {
    "matmul": 2.0,
    "attention": 0.0,  # moved to attention_backward: the fused backward, 2.5 forwards (five products to two)
    "attention_backward": 0.0,
    "recurrent": 0.0,  # moved to recurrent_backward: two forwards
    "recurrent_backward": 0.0,
    "selection": 0.0,  # DSA's index scores take no gradient
    "memory": 0.0,
    "gathered": 2.0,  # gathered again in backward, and the rows' gradients scattered back
    "elementwise": 2.0,
    "launches": 2.0,
    "branch_calls": 2.0,
    "decode_calls": 0.0,
    "comm": 0.0,
    "host": 0.0,
    "host_step": 0.0,
}
COMPUTE_CLASSES = (
    *("matmul", "attention", "attention_backward", "recurrent", "recurrent_backward", "selection", "elementwise"),
)
EXACT_CHUNKS = 2048  # chunks counted one by one (beyond: runs summed from their ends)


@dataclass(frozen=True)
class Work:
    """What a phase does on one rank, by class (FLOPs, bytes, layer calls)."""

    matmul: float = 0.0
    attention: float = 0.0
    attention_backward: float = 0.0
    recurrent: float = 0.0
    recurrent_backward: float = 0.0
    selection: float = 0.0
    elementwise: float = 0.0
    memory: float = 0.0
    gathered: float = 0.0
    launches: float = 0.0
    branch_calls: float = 0.0
    decode_calls: float = 0.0
    comm: float = 0.0
    host: float = 0.0  # bytes between host and device (offload: the shards in, their gradients out)
    host_step: float = 0.0  # bytes the optimizer's step reads and writes in host memory (offload: AdamW there)

    def __add__(self, other: Work) -> Work:
        return Work(**{name: getattr(self, name) + getattr(other, name) for name in WORK_CLASSES})

    def scaled(self, factor: float) -> Work:
        return Work(**{name: getattr(self, name) * factor for name in WORK_CLASSES})

    def backward(self, matmul: float = BACKWARD["matmul"]) -> Work:
        """The backward pass of this forward work (its communication counted by the caller); ``matmul``: the products
        its matmuls' backward takes per forward one (two: the input's gradient and the weight's; fewer where weights
        are frozen, ``ModelWork.backward_products``)."""
        work = Work(**{name: getattr(self, name) * BACKWARD[name] for name in WORK_CLASSES})
        return replace(
            work,
            matmul=self.matmul * matmul,
            attention_backward=2.5 * self.attention + self.attention_backward,
            recurrent_backward=2.0 * self.recurrent + self.recurrent_backward,
        )

    @property
    def flops(self) -> float:
        return self.matmul + self.attention + self.attention_backward + self.recurrent + self.recurrent_backward


WORK_CLASSES = tuple(f.name for f in fields(Work))


def total(works: Iterable[Work]) -> Work:
    result = Work()
    for work in works:
        result = result + work
    return result


# --- the model's work ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoutedWork:
    """A mixture of experts' routed experts (their stacked ``[experts, out, in]`` weights), as ``ModelWork`` counts
    them: per token at the routed share, and whole."""

    per_token: float = 0.0  # FLOPs of their matmuls for one token
    skipped_per_token: float = 0.0  # of those, the last layer's (a capture's last layer computes no MLP)
    outputs_per_token: float = 0.0  # elements they write for one token
    weight_bytes: float = 0.0  # every expert, in the compute dtype
    layers: frozenset[int] = frozenset()  # the MoE layers
    last_layer: bool = False  # whether the last layer is one

    def adding(self, name: str, p: Tensor, share: float, itemsize: int, last: bool) -> RoutedWork:
        """With the stacked experts' weight ``name`` (``p``: ``[experts, out, in]``) counted."""
        layer = int(name.split(".layers.")[1].split(".")[0])
        return RoutedWork(
            per_token=self.per_token + 2.0 * p.numel() * share,
            skipped_per_token=self.skipped_per_token + (2.0 * p.numel() * share if last else 0.0),
            outputs_per_token=self.outputs_per_token + p.shape[1] * share,
            weight_bytes=self.weight_bytes + p.numel() * itemsize,
            layers=self.layers | {layer},
            last_layer=self.last_layer or last,
        )

    def calls(self, entries_only: bool = False) -> int:
        """MoE calls in one pass over the layers (``entries_only``: the last layer's MLP skipped)."""
        return len(self.layers) - (1 if entries_only and self.last_layer else 0)


@dataclass(frozen=True)
class ModelWork:
    """Per-token and per-pair work of one model: counted once from its config (the weights on the meta device)."""

    config: PretrainedConfig
    dtype: torch.dtype
    linear_per_token: float  # FLOPs of the decoder layers' weight matmuls for one token
    skipped_per_token: float  # of those, the last layer's that its state entries do not need (a capture skips them)
    outputs_per_token: float  # elements the layers' matmuls write for one token: what the elementwise kernels around
    # them (norms, rotations, activations, residuals, merges) go over
    weight_bytes: float  # every parameter, in ``dtype``
    active_weight_bytes: float  # the weights one token reads (a mixture of experts: its routed share)
    root_bytes: float = 0.0  # of ``weight_bytes``, the root unit's: embeddings, final norm, LM head (FSDP2's root)
    routed: RoutedWork = field(default_factory=RoutedWork)  # of the above, the routed experts'
    # the share of the routed experts' work a rank does: 1, or 1 / cp under expert parallelism (each rank its own
    # experts on every token; routing assumed even over the experts), whose backward recomputes that share's forward
    experts: float = 1.0
    # a LoRA policy: the bytes of the parameters that train (of ``weight_bytes``; of ``root_bytes``), the share of
    # the layers' matmul FLOPs whose weights train, and whether the LM head's weight takes a gradient
    trained_bytes: float | None = None
    trained_root_bytes: float | None = None
    trained_share: float = 1.0
    head_trains: bool = True

    @classmethod
    def of(cls, config: PretrainedConfig, dtype: torch.dtype, lora: LoraSpec | None = None) -> ModelWork:
        adapter = adapter_class(config)
        itemsize = torch.empty((), dtype=dtype).element_size()
        last = f".layers.{config.num_hidden_layers - 1}."
        state = adapter.state_parameters(config)
        linear = skipped = outputs = weights = active = root = trained = trained_root = trained_linear = 0.0
        routed = RoutedWork()
        model = meta_model(config, dtype, lora)
        for name, p in model.named_parameters():
            share = adapter.active_fraction(config, name)
            weights += p.numel() * itemsize
            root += 0.0 if ".layers." in name else p.numel() * itemsize
            active += p.numel() * itemsize * share
            if p.requires_grad:
                trained += p.numel() * itemsize
                trained_root += 0.0 if ".layers." in name else p.numel() * itemsize
            if ".layers." in name and p.dim() >= 2:  # matrices (and the depthwise convolution's kernel)
                linear += 2.0 * p.numel() * share
                trained_linear += 2.0 * p.numel() * share if p.requires_grad else 0.0
                packed_experts = p.dim() == 3 and ".experts." in f".{name}"  # [experts, out, in]
                outputs += p.shape[1 if packed_experts else 0] * share
                is_last = last in name and not transformers_name(name).endswith(state)
                if is_last:
                    skipped += 2.0 * p.numel() * share
                if packed_experts:
                    routed = routed.adding(name, p, share, itemsize, is_last)
        if lora is None:
            return cls(config, dtype, linear, skipped, outputs, weights, active, root, routed)
        head = model.lm_head
        return cls(
            config, dtype, linear, skipped, outputs, weights, active, root, routed,
            trained_bytes=trained, trained_root_bytes=trained_root, trained_share=trained_linear / linear,
            head_trains=bool(lora_layers(head)) or head.weight.requires_grad,
        )  # fmt: skip

    @property
    def gradient_bytes(self) -> float:
        """The bytes of the parameters that take a gradient (``weight_bytes``'s, all of them unless LoRA)."""
        return self.weight_bytes if self.trained_bytes is None else self.trained_bytes

    @property
    def root_gradient_bytes(self) -> float:
        return self.root_bytes if self.trained_root_bytes is None else self.trained_root_bytes

    @property
    def backward_products(self) -> float:
        """The products the layers' matmuls take in backward per forward one: the input's gradient, and the weight's
        where it trains (2 when everything trains)."""
        return 1.0 + self.trained_share

    @property
    def head_products(self) -> float:
        """The LM head's products per scored token in a replay: forward, its tiles again in backward, the hidden
        states' gradient, and its weight's where it trains."""
        return 4.0 if self.head_trains else 3.0

    @property
    def layers(self) -> int:
        return int(self.config.num_hidden_layers)

    @property
    def layer_bytes(self) -> float:
        """The decoder layers' weights (``weight_bytes`` without the root unit's)."""
        return self.weight_bytes - self.root_bytes

    def _skipped_share(self) -> float:
        return self.skipped_per_token / self.linear_per_token if self.linear_per_token else 0.0

    def forward(self, new: int, earlier: int, entries_only: bool = False) -> Work:
        """One call of every layer on ``new`` positions after ``earlier`` ones (no LM head); ``entries_only``: the
        last layer computes its state entries alone (a capture's chunk: no attention, no MLP there). The routed
        experts' matmuls count at the rank's share (``experts``)."""
        layers = adapter_class(self.config).layer_work(self.config, new, earlier, self.itemsize)
        if entries_only:  # the last layer: its state entries alone (a recurrent layer still runs its recurrence)
            last = layers[-1]
            layers = [*layers[:-1], LayerWork(recurrent=last.recurrent, steps=last.steps if last.recurrent else 0)]
        elsewhere = 1.0 - self.experts  # the routed work other ranks' experts do
        routed, routed_outputs = self._routed(entries_only)
        return Work(
            matmul=(self.linear_per_token - (self.skipped_per_token if entries_only else 0.0) - elsewhere * routed)
            * new,
            elementwise=(
                self.outputs_per_token * (1.0 - self._skipped_share() if entries_only else 1.0)
                - elsewhere * routed_outputs
            )
            * new,
            attention=sum(w.attention for w in layers),
            recurrent=sum(w.recurrent for w in layers),
            selection=sum(w.selection for w in layers),
            gathered=sum(w.gathered for w in layers),
            launches=self.layers + sum(w.steps for w in layers),
        )

    def chunked(self, start: int, end: int, chunk: int, entries_only: bool = False) -> Work:
        """Positions ``start..end`` in chunks of ``chunk`` (a capture, a walk, a long extend). Past
        ``EXACT_CHUNKS`` whole chunks, runs of them are summed from their ends — exact where a chunk's work is
        affine in the positions before it (attention's pairs are; DSA's switch to top-k rows falls in one run)."""
        whole = max(0, (end - start) // chunk)
        run = max(1, -(-whole // EXACT_CHUNKS))
        works = []
        for first in range(0, whole, run):
            count = min(run, whole - first)
            ends = self.forward(chunk, start + first * chunk, entries_only) + self.forward(
                chunk, start + (first + count - 1) * chunk, entries_only
            )
            works.append(ends.scaled(count / 2))
        if start + whole * chunk < end:
            works.append(self.forward(end - start - whole * chunk, start + whole * chunk, entries_only))
        return total(works)

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def _routed(self, entries_only: bool) -> tuple[float, float]:
        """The routed experts' FLOPs and written elements per token, at full share."""
        flops = self.routed.per_token - (self.routed.skipped_per_token if entries_only else 0.0)
        outputs = self.routed.outputs_per_token * (flops / self.routed.per_token if flops else 0.0)
        return flops, outputs

    def routed_recompute(self, tokens: int, entries_only: bool = False) -> Work:
        """What a backward pass over ``tokens`` adds under expert parallelism (a share below 1): the rank's experts'
        forward again (``parallel.experts``' node keeps no graph, as FSDP2 gathers again); nothing otherwise."""
        if self.experts == 1.0:
            return Work()
        flops, outputs = self._routed(entries_only)
        return Work(matmul=flops * self.experts * tokens, elementwise=outputs * self.experts * tokens)

    def decoded_weight_bytes(self, tokens: int) -> float:
        """The weights a decoding step of ``tokens`` tokens reads on a rank: every weight but the routed experts'
        once, and of those the experts the tokens chose (their active share each, at most all of them), the rank's
        ``experts`` share."""
        routed = self.routed.weight_bytes
        dense = self.weight_bytes - routed
        chosen = min(routed, (self.active_weight_bytes - dense) * tokens)
        return dense + chosen * self.experts

    def head(self, tokens: int) -> Work:
        """The LM head's log-probs of ``tokens`` positions."""
        return Work(matmul=2.0 * self.config.hidden_size * self.config.vocab_size * tokens)

    def entries_bytes(self, positions: int) -> float:
        """The state entries of ``positions`` positions (attention K/V, MLA latents, DSA index keys: what grows)."""
        return state_size(self.config, self.dtype).bytes_per_token * positions

    def state_bytes(self, positions: int, ranks: int = 1) -> float:
        """A state of ``positions`` positions, as one of ``ranks`` context-parallel ranks holds it: its share of the
        positions' entries, and the recurrent states whole (every rank steps them)."""
        fixed = state_size(self.config, self.dtype).fixed_bytes
        return self.entries_bytes(positions) / ranks + (fixed if positions else 0)

    def attention_layers(self) -> int:
        return sum(1 for w in adapter_class(self.config).layer_work(self.config, 1, 0, self.itemsize) if w.attention)


# --- a step's phases on one rank ----------------------------------------------------------------------------


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

    def _gathers(self, passes: int, root: bool = False, frozen: bool = False, expert_passes: int | None = None) -> Work:
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

    def _experts_in(self, passes: int, shard_itemsize: int) -> Work:
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
        waves = capture_waves([owner for _, _, owner in runs])
        if not request.dispatched:
            return slowest.work + rows + self._gathers(waves, root=True)
        # each peer's part of a round copies the rank's (offloaded) experts of its layer in: at most a copy of them
        # all per chunk of the prompt, as a replicated capture makes
        gathers = self._gathers(waves, root=True, expert_passes=self._chunks)
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
            # per wave of runs (a balanced cut's two) each layer gathered and reduced, and gathered once more for the
            # recomputation (paced over both waves under FSDP2: ``walk_events``)
            waves = capture_waves([owner for _, _, owner in cut_runs(self.captured, self.cp, request.balanced_context)])
            weights = self._gathers(1 + waves) + self._layer_reductions().scaled(waves)
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


# --- hardware -----------------------------------------------------------------------------------------------


FLOP_CLASSES = ("matmul", "attention", "attention_backward", "recurrent", "recurrent_backward")


class Efficiency(BaseModel):
    """Achieved / peak rate of each class of work (measured: ``calibrate``)."""

    model_config = ConfigDict(frozen=True)

    matmul: float = Field(gt=0)
    attention: float = Field(gt=0)
    attention_backward: float = Field(gt=0)
    recurrent: float = Field(gt=0)
    memory: float = Field(gt=0)
    link: float = Field(gt=0)
    recurrent_backward: float | None = Field(default=None, gt=0)  # None: the forward's (``recurrent``)

    def of(self, name: str) -> float:
        """The efficiency of class ``name`` (the delta rule's backward at its forward's where not measured)."""
        if name == "recurrent_backward" and self.recurrent_backward is None:
            return self.recurrent
        return float(getattr(self, name))


class HardwareProfile(BaseModel):
    """One accelerator: its peaks (the vendor's figures) and the efficiencies measured on it."""

    model_config = ConfigDict(frozen=True)

    name: str
    peak_flops: float = Field(gt=0)  # dense bf16 FLOP/s
    memory_bandwidth: float = Field(gt=0)  # bytes/s
    link_bandwidth: float = Field(gt=0)  # bytes/s per GPU and direction (NVLink, or the host's for a CPU)
    # bytes/s per GPU and direction between host and device: PCIe Gen5 x16 (64 GB/s), as pinned copies reach it
    host_bandwidth: float = Field(default=55e9, gt=0)
    # bytes/s of host memory one GPU's process gets for an offloaded optimizer step (torch's AdamW, a tensor at a
    # time): this machine's 2 cores reach 7-10 GB/s (bench/ceilings.py's host_step_rate); a prior of about 30 for a
    # GPU node's ~14 cores per GPU, not measured
    host_step_bandwidth: float = Field(default=30e9, gt=0)
    launch_s: float = Field(ge=0)  # seconds per layer call or sequential step of a chunk (host-side)
    branch_call_s: float = Field(ge=0)  # ... of a branch's extend
    decode_call_s: float = Field(ge=0)  # ... of a batched decoding step
    selection_s: float = Field(ge=0)  # seconds per (query, key) index score (DSA: scoring and its top-k)
    elementwise_s: float = Field(default=0.0, ge=0)  # seconds per matmul output element, for the kernels around it
    gather_s: float = Field(default=0.0, ge=0)  # seconds per byte gathered row by row (and scattered back)
    efficiency: Efficiency
    measured_on: str  # where the efficiencies come from

    def peaks(self) -> dict[str, float]:
        """The peak rate of each class whose achieved rate is an ``efficiency`` of it."""
        flops = dict.fromkeys(FLOP_CLASSES, self.peak_flops)
        return {**flops, "memory": self.memory_bandwidth}

    def rates(self) -> dict[str, float]:
        """Units of each class per second."""
        rates = {name: peak * self.efficiency.of(name) for name, peak in self.peaks().items()}
        links = {"comm": self.link_bandwidth * self.efficiency.link, "host": self.host_bandwidth}
        return {**rates, **links, "host_step": self.host_step_bandwidth}

    def seconds(self, work: Work) -> dict[str, float]:
        """Seconds of each class of ``work`` (their sum is the phase's time)."""
        rates = self.rates()
        spent = {name: getattr(work, name) / rate for name, rate in rates.items()}
        spent["selection"] = work.selection * self.selection_s
        spent["elementwise"] = work.elementwise * self.elementwise_s
        spent["gathered"] = work.gathered * self.gather_s
        spent["launches"] = work.launches * self.launch_s + work.branch_calls * self.branch_call_s
        spent["launches"] += work.decode_calls * self.decode_call_s
        return spent

    def time(self, work: Work) -> float:
        return sum(self.seconds(work).values())


def calibrate(
    profile: HardwareProfile,
    samples: Sequence[tuple[Work, float]],
    name: str | None = None,
    keep: Sequence[str] = (),
) -> HardwareProfile:
    """``profile`` with the rates that best predict ``samples`` (work, measured seconds): non-negative least squares
    on relative error, each class pulled weakly towards ``profile``'s own rate, so that a class the samples barely
    exercise keeps it; the classes in ``keep`` (measured directly: a large matmul, a copy) are not fitted.
    (Communication is not fitted either: one process sends nothing.)"""
    prior = _unit_seconds(profile)
    used = [c for c in FITTED if c not in keep and any(getattr(w, c) for w, _ in samples)]
    kept = [c for c in FITTED if c not in used]
    # unknowns: each class's seconds per unit as a multiple of the prior's (well scaled whatever the units); the
    # kept classes' seconds are taken off each sample first
    rows, targets = [], []
    for work, seconds in samples:
        rest = seconds - sum(getattr(work, c) * prior[c] for c in kept)
        rows.append([getattr(work, c) * prior[c] / seconds for c in used])
        targets.append(max(rest, 0.0) / seconds)
    pull = 1e-4  # the prior's weight against one sample's relative error: it decides only what the samples leave open
    for k in range(len(used)):
        rows.append([pull if j == k else 0.0 for j in range(len(used))])
        targets.append(pull)
    ratios = _nonnegative_least_squares(np.array(rows), np.array(targets))
    peaks = profile.peaks()
    unit = dict(prior)
    for c, ratio in zip(used, ratios, strict=True):
        # no class beats its peak (a class the samples leave at 0 runs at its peak), none is free
        unit[c] = max(prior[c] * float(ratio), 1.0 / peaks[c] if c in peaks else prior[c] * 1e-3)
    efficiency = profile.efficiency.model_copy(update={c: 1.0 / (unit[c] * peaks[c]) for c in peaks})
    update = {
        "launch_s": unit["launches"],
        "branch_call_s": unit["branch_calls"],
        "decode_call_s": unit["decode_calls"],
        "selection_s": unit["selection"],
        "elementwise_s": unit["elementwise"],
        "gather_s": unit["gathered"],
        "measured_on": name or profile.measured_on,
    }
    return profile.model_copy(update={"efficiency": efficiency, **update})


FITTED = (
    *("matmul", "attention", "attention_backward", "recurrent", "recurrent_backward", "selection", "elementwise"),
    *("memory", "gathered"),
    *("launches", "branch_calls", "decode_calls"),
)


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0 (an active set: the most negative unknown is held at 0 until none is)."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        solution, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (solution >= 0).all():
            x[free] = solution
            break
        free.pop(int(np.argmin(solution)))
    return x


def _unit_seconds(profile: HardwareProfile) -> dict[str, float]:
    """Seconds per unit of each fitted class."""
    rates = profile.rates()
    unit = {c: 1.0 / rates[c] for c in profile.peaks()}
    unit["launches"] = max(profile.launch_s, 1e-9)
    unit["branch_calls"] = max(profile.branch_call_s, 1e-9)
    unit["decode_calls"] = max(profile.decode_call_s, 1e-9)
    unit["selection"] = max(profile.selection_s, 1e-15)
    unit["elementwise"] = max(profile.elementwise_s, 1e-15)
    unit["gathered"] = max(profile.gather_s, 1e-15)
    return unit


NVLINK_BYTES_PER_S = 450e9  # NVLink 4: 900 GB/s per GPU, both directions together
# An H200: matmul and memory at what a large bf16 matmul (788 TFLOP/s) and a device copy (4.3 TB/s) reached on one
# here; attention at 0.35 of peak (FlashAttention-2's forward on Hopper; the dense capture's growth from 32K to 128K
# on one here, where attention dominates, gives 0.32), its backward 0.25; the host latencies are not measured on it
# (they matter for small models only: bench/timing.py). bench/ceilings.py measures all of them on a GPU run.
H200_PRIOR = HardwareProfile(
    name="H200",
    peak_flops=989e12,
    memory_bandwidth=4.8e12,
    link_bandwidth=NVLINK_BYTES_PER_S,
    launch_s=30e-6,
    branch_call_s=100e-6,
    decode_call_s=100e-6,
    selection_s=1e-12,
    elementwise_s=3e-12,  # about six bf16 passes over each element at the copy's rate
    gather_s=1e-12,  # rows of a kilobyte or more gather near the copy's rate
    efficiency=Efficiency(matmul=0.8, attention=0.35, attention_backward=0.25, recurrent=0.2, memory=0.9, link=0.7),
    measured_on="matmul and copy rates measured on an H200, attention and host latencies typical, not measured",
)


def hopper(name: str, peak_flops: float, memory_bandwidth: float, measured: HardwareProfile) -> HardwareProfile:
    """A Hopper GPU at its own peaks with ``measured``'s efficiencies and host latencies (an H200's)."""
    return measured.model_copy(update={"name": name, "peak_flops": peak_flops, "memory_bandwidth": memory_bandwidth})


PROFILES: dict[str, HardwareProfile] = {
    "h200": H200_PRIOR,
    "h100": hopper("H100 SXM", 989e12, 3.35e12, H200_PRIOR),
    "h20": hopper("H20", 148e12, 4.0e12, H200_PRIOR),
}


def measured_profile(record: dict, family: str, links: HardwareProfile) -> HardwareProfile:
    """The profile ``bench/gpu.py`` measured for ``family`` on one GPU (its record's ``setup[family]["profile"]``;
    ``bench/timing.py``'s output, ``profiles[family]``, and a bare profile are read too), with the interconnect and
    host links of ``links`` (one process measures neither): every compute, memory and per-call rate from the run's
    micro-benchmarks, none from typical fractions."""
    if "setup" in record:
        measured = (record["setup"].get(family) or {}).get("profile")
        found = sorted(f for f, s in record["setup"].items() if s and s.get("profile"))
    elif "profiles" in record:
        measured, found = record["profiles"].get(family), sorted(record["profiles"])
    else:
        measured, found = record, []
    if measured is None:
        raise ValueError(
            f"the record has no profile measured for the {family} family (it has: {', '.join(found) or 'none'})"
        )
    profile = HardwareProfile(**measured)
    efficiency = profile.efficiency.model_copy(update={"link": links.efficiency.link})
    return profile.model_copy(
        update={
            "link_bandwidth": links.link_bandwidth,
            "host_bandwidth": links.host_bandwidth,
            "efficiency": efficiency,
            "measured_on": f"{profile.measured_on}; links: {links.name}'s",
        }
    )


# --- the step's time ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepTime:
    """A step's phases in seconds on ``profile`` (each the sum of its classes), the communication's share."""

    work: StepWork
    profile: HardwareProfile

    def phase_seconds(self) -> dict[str, float]:
        return {name: self.profile.time(work) for name, work in self.work.phases.items()}

    def training_seconds(self) -> float:
        """The step without rollouts (what a served policy leaves to the trainer's GPUs)."""
        return sum(s for name, s in self.phase_seconds().items() if name != "rollout")

    def comm_share(self, kind: str = "comm") -> float:
        """The step's (without rollouts) share of ``kind``: "comm" (the interconnect's collectives and messages),
        "host" (offload's copies between host and device) or "host_step" (AdamW's step in host memory)."""
        train = [w for name, w in self.work.phases.items() if name != "rollout"]
        spent = sum(self.profile.seconds(w)[kind] for w in train)
        return spent / max(self.training_seconds(), 1e-30)

    def table(self) -> str:
        request = self.work.request
        lines = [
            f"Time model ({self.profile.name}; efficiencies: {self.profile.measured_on}) — a model output, "
            "not a measurement",
            f"{'phase':<10} {'seconds':>10} {'compute':>9} {'comm':>9} {'host':>9} {'memory':>9} {'launches':>9}"
            "  TFLOP",
        ]
        for name, work in self.work.phases.items():
            spent = self.profile.seconds(work)
            compute = sum(spent[c] for c in COMPUTE_CLASSES)
            host = spent["host"] + spent["host_step"]  # offload's copies and the optimizer's step there
            lines.append(
                f"{name:<10} {sum(spent.values()):>10.2f} {compute:>9.2f} {spent['comm']:>9.2f} {host:>9.2f} "
                f"{spent['memory']:>9.2f} {spent['launches']:>9.2f}  {work.flops / 1e12:.1f}"
            )
        gpus = f"each of {request.gpus} GPUs" if request.gpus > 1 else "one GPU"
        lines.append(
            f"step (without rollouts): {self.training_seconds():.1f} s on {gpus}, "
            f"communication {100 * self.comm_share():.0f} % of it"
            + (f", host copies {100 * self.comm_share('host'):.0f} %" if request.offload else "")
            + (f", the host's AdamW step {100 * self.comm_share('host_step'):.0f} %" if request.offload else "")
            + " (not overlapped: an upper estimate)"
        )
        return "\n".join(lines)


def step_time(request: PlanRequest, profile: HardwareProfile, rollout: bool = True) -> StepTime:
    return StepTime(step_work(request, rollout=rollout), profile)
