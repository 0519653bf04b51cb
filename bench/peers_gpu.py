"""transformers' own model beside the engine on the same device: the peer of each phase ``bench/gpu.py`` times.

The peer is the engine's own model object (a transformers CausalLM: the same weights, device and dtype), run the way
its users run it, with transformers' default kernels:

- capture <-> ``model.model(context, use_cache=True)`` without a graph: one forward without the LM head that builds
  transformers' cache (``DynamicCache``), as a user's prefill. Where one forward runs out of memory, the context
  goes through the same cache in pieces of the engine's chunk size (labelled ``chunked prefill``).
- scoring <-> the G completions as one batch over the context's cache expanded to G rows, without a graph, and the
  log-probs of their targets from the logits (fp32 log-softmax, TRL's ``selective_log_softmax``). The expansion is
  ``Cache.reorder_cache`` with G zeros (transformers' way to pick batch rows: its linear-attention layers have no
  ``batch_repeat_interleave``), a G-fold copy of the cache that the engine does not make; it is timed with the phase.
- replay <-> the same under autograd, the on-policy GRPO loss, one backward; the cache's tensors are constants (the
  capture kept no graph). transformers' linear-attention cache writes a layer's new recurrent state into the old
  one (``copy_``), which autograd refuses once the old one is saved for backward ("modified by an inplace
  operation"); the expanded copy's layers assign the new state instead (labelled ``state assigned``).
- decode <-> ``generate`` (greedy, exactly N new tokens) for G sequences from the expanded cache of the P context
  positions: N forwards of one token each (the prompt's last token, then N - 1 generated ones), as the engine's N
  batched steps. The clock covers the expansion and ``generate``; the prefill is the capture row's.

Kernels: transformers' SDPA attention; glm_moe_dsa's experts at the fastest of transformers' implementations that
agree with ``"eager"`` on this device (timed on one chunk when the peer is set up); qwen3_5's GatedDeltaNet with
flash-linear-attention where transformers finds it installed and it agrees with transformers' torch fallback on this
device (forward; and backward, for the replay), else the torch fallback — ``torch fallback`` in the row's label.
A phase whose G members do not fit in memory at once runs them in halves until they do (``members per forward``
in its label), a capture that does not fit in one forward chunk by chunk; the phase is timed again each time.
"""

from __future__ import annotations

import copy
import gc
import importlib
import inspect
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from bench.peers import ADVANTAGE_EPS, selective_log_softmax
from longstraw_agents.models.presets import CACHE_KEYWORD, forward_with_cache, returned_cache

QWEN3_5 = "transformers.models.qwen3_5.modeling_qwen3_5"
EXPERTS_CANDIDATES = ("grouped_mm", "batched_mm", "eager")  # transformers' default first
EXPERTS_TOLERANCE = 5e-2  # relative L2 of the last hidden state against "eager" (bf16 models)
# relative L2 of fla against transformers' torch fallback on the same inputs: fp32 (TF32 products), 16-bit
DELTA_RULE_TOLERANCE = {torch.float32: 2e-2, torch.bfloat16: 6e-2, torch.float16: 6e-2}


@dataclass(frozen=True)
class PeerWork:
    """What the peer computes at one context length: the P context tokens, the G completions' inputs (the prompt's
    last token, then each completion but its last token) and targets ``[G, C]``, their rewards, the full prompt
    (for ``generate``) and N, the tokens decoded."""

    context: Tensor
    prompt: Tensor
    inputs: Tensor
    targets: Tensor
    rewards: Tensor
    new_tokens: int

    @classmethod
    def of(cls, prompt: Tensor, completions: list[Tensor], rewards: list[float], new_tokens: int) -> PeerWork:
        targets = torch.stack(completions)
        inputs = torch.cat([prompt[-1:].expand(len(completions), 1), targets[:, :-1]], dim=1)
        return cls(prompt[:-1], prompt, inputs, targets, torch.tensor(rewards), new_tokens)

    @property
    def members(self) -> int:
        return self.targets.shape[0]


# --- transformers' cache ------------------------------------------------------------------------------------------


def _tensors(obj: Any, found: dict[int, Tensor], seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        found[id(obj)] = obj
    elif isinstance(obj, dict):
        for value in obj.values():
            _tensors(value, found, seen)
    elif isinstance(obj, list | tuple):
        for value in obj:
            _tensors(value, found, seen)
    elif hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            _tensors(value, found, seen)


def expanded(cache: Any, members: int) -> Any:
    """A copy of ``cache`` with ``members`` rows, each the context's (``reorder_cache`` with zeros), leaving
    ``cache`` as it was: its layers and their containers copied, its tensors shared (the reorder replaces them)."""
    memo: dict[int, Any] = {}
    _tensors(cache, memo, set())
    fork = copy.deepcopy(cache, memo)
    fork.reorder_cache(torch.zeros(members, dtype=torch.long))
    return fork


def _assign_recurrent_state(layer: Any, recurrent_states: Tensor, state_idx: int = 0, **kwargs: Any) -> Tensor:
    """A linear-attention cache layer's ``update_recurrent_state`` that keeps the new state instead of copying it
    into the old one (which autograd may have saved)."""
    layer.recurrent_states[state_idx] = recurrent_states
    layer.is_recurrent_states_initialized[state_idx] = True
    return recurrent_states


def states_assigned(cache: Any) -> bool:
    """Make ``cache``'s linear-attention layers assign their new recurrent states; whether it has such layers."""
    linear = [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]
    for layer in linear:
        layer.update_recurrent_state = types.MethodType(_assign_recurrent_state, layer)
    return bool(linear)


# --- kernels ------------------------------------------------------------------------------------------------------


@dataclass
class DeltaRule:
    """qwen3_5's GatedDeltaNet functions as transformers resolved them (flash-linear-attention's where installed) and
    its torch fallbacks; which of the two each phase runs."""

    chunk: Callable[..., Any]
    recurrent: Callable[..., Any]
    forward_kernel: bool  # flash-linear-attention in forward-only phases
    backward_kernel: bool  # ... in the replay
    why: str  # why the torch fallback runs where it does

    @classmethod
    def probe(cls, config: Any, device: torch.device, dtype: torch.dtype) -> DeltaRule:
        module = importlib.import_module(QWEN3_5)
        chunk, recurrent = module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule
        try:
            importlib.import_module("fla.ops.gated_delta_rule")
        except ImportError:
            return cls(chunk, recurrent, False, False, "flash-linear-attention is not installed")
        forward = _agrees(chunk, recurrent, config, device, dtype, backward=False)
        if forward is not None:
            return cls(chunk, recurrent, False, False, f"flash-linear-attention's forward fails here: {forward}")
        backward = _agrees(chunk, recurrent, config, device, dtype, backward=True)
        why = "" if backward is None else f"flash-linear-attention's backward fails here: {backward}"
        return cls(chunk, recurrent, True, backward is None, why)

    def kernel(self, phase: str) -> bool:
        return self.backward_kernel if phase == "replay" else self.forward_kernel

    def label(self, phase: str) -> str:
        return "flash-linear-attention" if self.kernel(phase) else f"torch fallback ({self.why})"

    @contextmanager
    def running(self, phase: str) -> Iterator[None]:
        """transformers' qwen3_5 module with the functions ``phase`` runs."""
        if self.kernel(phase):
            yield
            return
        module = importlib.import_module(QWEN3_5)
        module.torch_chunk_gated_delta_rule = inspect.unwrap(self.chunk)
        module.torch_recurrent_gated_delta_rule = inspect.unwrap(self.recurrent)
        try:
            yield
        finally:
            module.torch_chunk_gated_delta_rule, module.torch_recurrent_gated_delta_rule = self.chunk, self.recurrent


def _relative(got: Tensor, want: Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _agrees(
    chunk: Callable[..., Any],
    recurrent: Callable[..., Any],
    config: Any,
    device: torch.device,
    dtype: torch.dtype,
    backward: bool,
) -> str | None:
    """None where transformers' resolved delta-rule functions (chunked, and recurrent for forward) equal their torch
    fallbacks on ``device`` as transformers calls them in a ``dtype`` model at ``config``'s head layout (q, k, v and
    beta in ``dtype``, the decay and the state in fp32): outputs, final states and, with ``backward``, the gradients
    of every input and the initial state; else what went wrong, in one line."""
    gen = torch.Generator().manual_seed(0)
    n, hk, hv = 150, config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    tolerance = DELTA_RULE_TOLERANCE.get(dtype, DELTA_RULE_TOLERANCE[torch.float32])

    def made(t: Tensor, to: torch.dtype = dtype) -> Tensor:
        return t.to(device, to).requires_grad_(backward)

    q, k = made(torch.randn(1, n, hk, dk, generator=gen)), made(torch.randn(1, n, hk, dk, generator=gen))
    v = made(torch.randn(1, n, hv, dv, generator=gen))
    g = made(-torch.rand(1, n, hv, generator=gen), torch.float32)
    beta = made(torch.rand(1, n, hv, generator=gen))
    state = made(0.1 * torch.randn(1, hv, dk, dv, generator=gen), torch.float32)
    inputs = (q, k, v, g, beta, state)
    functions = [chunk] if backward else [chunk, recurrent]
    try:
        for function in functions:
            got, want = (_delta_rule_outputs(f, inputs, backward) for f in (function, inspect.unwrap(function)))
            names = ("output", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate")[: len(got)]
            for name, a, b in zip(names, got, want, strict=True):
                if (error := _relative(a, b)) > tolerance:
                    return f"{function.__name__} {name} off by {error:.2g}"
    except Exception as err:  # whatever the kernel raises (its guards, Triton's compiler)
        return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
    return None


def _delta_rule_outputs(function: Callable[..., Any], inputs: tuple[Tensor, ...], backward: bool) -> list[Tensor]:
    q, k, v, g, beta, state = inputs
    out, final = function(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    if not backward:
        return [out, final]
    probe = torch.ones_like(out)
    grads = torch.autograd.grad((out * probe).sum() + final.sum(), inputs)
    return [out, final, *grads]


def choose_experts(model: Any, ids: Tensor) -> tuple[str, dict[str, Any]]:
    """The fastest of ``EXPERTS_CANDIDATES`` whose forward of ``ids`` agrees with "eager"'s, and what each did
    (seconds of a second forward, or why it was refused)."""
    tried: dict[str, Any] = {}
    reference = None
    for name in ("eager", *[c for c in EXPERTS_CANDIDATES if c != "eager"]):
        try:
            model.set_experts_implementation(name)
            with torch.no_grad():
                model.model(ids[None])  # (its kernels compiled, tuned)
                start = _synchronized(ids.device)
                hidden = model.model(ids[None]).last_hidden_state
                seconds = _synchronized(ids.device) - start
        except Exception as err:  # an implementation this device or dtype does not take
            tried[name] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200]
            continue
        reference = hidden if reference is None else reference
        error = _relative(hidden, reference)
        tried[name] = seconds if error <= EXPERTS_TOLERANCE else f"off by {error:.2g} against eager"
    timed = {name: s for name, s in tried.items() if isinstance(s, float)}
    chosen = min(timed, key=timed.__getitem__)
    model.set_experts_implementation(chosen)
    return chosen, tried


def _synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --- the peer -----------------------------------------------------------------------------------------------------


@dataclass
class Transformers:
    """transformers' model doing each phase's work (see the module's docstring); ``batch``: members per forward of
    each phase (G, halved where G ran out of memory)."""

    model: Any
    chunk: int
    temperature: float = 1.0
    delta_rule: DeltaRule | None = None
    experts: str | None = None
    setup: dict[str, Any] = field(default_factory=dict)
    batch: dict[str, int] = field(default_factory=dict)
    chunked_prefill: bool = False
    left_out: dict[str, str] = field(default_factory=dict)  # phases not timed: why

    @classmethod
    def prepare(cls, model: Any, chunk: int, temperature: float = 1.0) -> Transformers:
        """The peer of ``model`` (its attention set to SDPA, its kernels chosen on its device)."""
        model.set_attn_implementation("sdpa")
        device = next(model.parameters()).device
        peer = cls(model, chunk, temperature, setup={"attention": "sdpa"})
        if model.config.model_type == "qwen3_5_text":
            peer.delta_rule = DeltaRule.probe(model.config, device, model.dtype)
            peer.setup["delta_rule"] = {
                "forward": "flash-linear-attention" if peer.delta_rule.forward_kernel else "torch fallback",
                "backward": "flash-linear-attention" if peer.delta_rule.backward_kernel else "torch fallback",
                "why": peer.delta_rule.why,
            }
        if model.config.model_type == "glm_moe_dsa":
            peer.left_out["decode"] = (
                "not the same work: transformers' cached DSA path selects other keys than DSA's definition when "
                "index_topk < context (its logits change as later tokens are added)"
            )
        if getattr(model.config, "n_routed_experts", None):
            ids = torch.randint(0, model.config.vocab_size, (chunk,), generator=torch.Generator().manual_seed(0))
            peer.experts, peer.setup["experts"] = choose_experts(model, ids.to(device))
        return peer

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def label(self, phase: str) -> str:
        """The kernels and workarounds the peer runs ``phase`` with."""
        parts = ["sdpa"]
        if self.experts is not None:
            parts.append(f"experts {self.experts}")
        if self.delta_rule is not None:
            parts.append(f"delta rule: {self.delta_rule.label(phase)}")
        if phase == "capture" and self.chunked_prefill:
            parts.append(f"chunked prefill ({self.chunk} tokens: one forward ran out of memory)")
        if phase == "replay" and self.delta_rule is not None:
            parts.append("recurrent state assigned (transformers' in-place copy breaks backward)")
        members = self.batch.get(phase)
        if members is not None:
            parts.append(f"{members} members per forward")
        return "; ".join(parts)

    @contextmanager
    def _running(self, phase: str) -> Iterator[None]:
        if self.delta_rule is None:
            yield
            return
        with self.delta_rule.running(phase):
            yield

    # -- phases (each the work the row's clock covers) --

    def capture(self, work: PeerWork) -> Any:
        """The context's prefill: transformers' cache of its P positions (in one forward, or chunk by chunk once
        one forward ran out of memory: ``smaller``)."""
        with torch.no_grad(), self._running("capture"):
            if not self.chunked_prefill:
                return returned_cache(self.model.model(work.context[None], use_cache=True))
            cache = None
            for start in range(0, len(work.context), self.chunk):
                piece = work.context[None, start : start + self.chunk]
                cache = returned_cache(forward_with_cache(self.model.model, piece, cache, use_cache=True))
            return cache

    def scoring(self, cache: Any, work: PeerWork) -> Tensor:
        """The targets' log-probs ``[G, C]`` from the context's cache."""
        with torch.no_grad(), self._running("scoring"):
            return torch.cat([self._logprobs(cache, work, rows) for rows in self._batches("scoring", work)])

    def replay(self, cache: Any, work: PeerWork) -> None:
        """The completions' forward under autograd from the context's (constant) cache, the on-policy GRPO loss
        (advantages normalised over the group, token-mean), one backward per batch."""
        rewards = work.rewards.to(self.device, torch.float32)
        advantages = (rewards - rewards.mean()) / (rewards.std() + ADVANTAGE_EPS)
        with self._running("replay"):
            for rows in self._batches("replay", work):
                logp = self._logprobs(cache, work, rows, assigned=True)
                ratio = torch.exp(logp - logp.detach())
                loss = -(ratio * advantages[rows, None]).sum() / work.targets.numel()
                loss.backward()

    def decode(self, cache: Any, work: PeerWork) -> None:
        """``generate``: exactly N new tokens (greedy) for the G members from the context's cache."""
        with torch.no_grad(), self._running("decode"):
            for rows in self._batches("decode", work):
                members = len(range(*rows.indices(work.members)))
                ids = work.prompt[None].expand(members, -1)
                self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), **{CACHE_KEYWORD: expanded(cache, members)},
                    max_new_tokens=work.new_tokens, min_new_tokens=work.new_tokens, do_sample=False,
                    pad_token_id=0,
                )  # fmt: skip

    def _logprobs(self, cache: Any, work: PeerWork, rows: slice, assigned: bool = False) -> Tensor:
        inputs, targets = work.inputs[rows], work.targets[rows]
        fork = expanded(cache, inputs.shape[0])
        if assigned:
            states_assigned(fork)
        logits = forward_with_cache(self.model, inputs, fork, use_cache=True).logits
        return selective_log_softmax(logits / self.temperature, targets)

    def _batches(self, phase: str, work: PeerWork) -> list[slice]:
        size = self.batch.setdefault(phase, work.members)
        return [slice(start, start + size) for start in range(0, work.members, size)]

    def smaller(self, phase: str) -> bool:
        """After ``phase`` ran out of memory: the capture chunk by chunk, another phase half as many members per
        forward; False where it already ran that way (one chunk, or one member, at a time)."""
        _free(self.device)
        if phase == "capture":
            done, self.chunked_prefill = self.chunked_prefill, True
            return not done
        size = self.batch.get(phase, 1)
        if size == 1:
            return False
        self.batch[phase] = (size + 1) // 2
        return True


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
