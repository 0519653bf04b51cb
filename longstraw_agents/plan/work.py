"""The work a phase does on one rank, by class (``Work``: FLOPs, bytes, layer calls; the classes are described in
``timing``), and the work of one model per token and per (query, key) pair (``ModelWork``), counted once from its
config on the meta device.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace

import torch
from torch import Tensor
from transformers import PretrainedConfig

from longstraw_agents.models import adapter_class, state_size
from longstraw_agents.models.base import LayerWork
from longstraw_agents.models.lora import LoraSpec, lora_layers, transformers_name
from longstraw_agents.plan.configs import meta_model

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
