"""The gated delta rule (GatedDeltaNet's recurrence), chunked: the pure-torch reference and the GPU kernels.

``chunk_gated_delta_rule`` is transformers' ``torch_chunk_gated_delta_rule`` (the UT transform within a block of
``chunk`` positions, a scan across blocks), written without a batch dimension and without in-place writes so that
autograd can replay it, in the inputs' precision (fp64 models stay fp64). It is split in two:

- ``block_terms``: every block's terms at once (``kernels.delta_terms.BlockTerms``), batched torch ops
  (differentiable through autograd);
- the scan across blocks: ``torch_scan`` (a Python loop of small matmuls: the reference, and the CPU path) or
  ``kernels.delta_scan.triton_scan`` (one Triton launch forward and one backward, with its own backward).

``delta_rule`` is what the GatedDeltaNet mixer calls. On a GPU:

- where no gradient flows (capture, scoring, decoding), flash-linear-attention's fully fused forward when it is
  installed and runs (a forward-only probe, once per device);
- otherwise (a replay or the exact walk's recomputation under autograd, or fla missing) the block terms in torch and
  the Triton scan. fla's own backward is never used: fla 0.6.0 refuses it on Hopper under Triton 3.4 to 3.7.0 (a
  compiler bug that gave wrong gradients), which is what torch 2.11's CUDA wheels ship.

Elsewhere (CPU, fp64, no Triton) the pure-torch scan runs. The suite tests the Triton scan on CPU in Triton's
interpreter against the pure-torch one in fp64.

``LONGSTRAW_DELTA_RULE`` (read at each call) narrows the choice on a GPU, for comparisons and for a kernel that failed
its GPU parity test (``bench/gpu.sh``): ``triton`` never uses fla, ``torch`` runs the pure-torch scan everywhere;
``auto`` (the default) is as above.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from longstraw_agents.kernels import triton_available
from longstraw_agents.kernels.delta_terms import BlockTerms, backward_buffers, forward_buffers

DELTA_CHUNK = 64  # positions per block of the chunked delta rule (as transformers' fallback and fla)


Scan = Callable[[BlockTerms, Tensor | None], tuple[Tensor, Tensor]]
"""A scan across blocks: ``(BlockTerms, initial state or None) -> (outputs [H, N, C, D_v], final state)``."""


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def block_terms(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int) -> BlockTerms:
    """The scan's terms per block of ``chunk`` positions, the input padded to whole blocks: zero padding has
    beta = 0 and g = 0, so it neither writes nor decays the state.

    q, k: ``[n, H, Dk]`` (already one per value head); v: ``[n, H, Dv]``; g (log decay, <= 0), beta: ``[n, H]``."""
    n, heads, dk = k.shape
    q = l2norm(q) * dk**-0.5
    k = l2norm(k)
    pad = (chunk - n % chunk) % chunk
    # [H, N, C, d]
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)).reshape(heads, -1, chunk, t.shape[-1]) for t in (q, k, v))
    beta, g = (F.pad(t.transpose(0, 1), (0, pad)).reshape(heads, -1, chunk) for t in (beta, g))
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    cum = g.cumsum(dim=-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair_decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair_decay
    return BlockTerms(
        w=torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True),
        u=torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True),
        q=q * cum.exp().unsqueeze(-1),
        a=(q @ k.transpose(-1, -2)) * pair_decay,
        k=k * (cum[..., -1:] - cum).exp().unsqueeze(-1),
        decay=cum[..., -1].exp(),
    )


def torch_scan(terms: BlockTerms, initial: Tensor | None) -> tuple[Tensor, Tensor]:
    """The scan across blocks in pure torch (see ``kernels.delta_scan`` for the recurrence)."""
    heads, _, _, dk, dv = terms.shape
    state = initial if initial is not None else terms.u.new_zeros(heads, dk, dv)
    decay = terms.decay[..., None, None]
    outs = []
    for c in range(terms.w.shape[1]):
        v_new = terms.u[:, c] - terms.w[:, c] @ state
        outs.append(terms.q[:, c] @ state + terms.a[:, c] @ v_new)
        state = state * decay[:, c] + terms.k[:, c].transpose(-1, -2) @ v_new
    return torch.stack(outs, dim=1), state


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    chunk: int = DELTA_CHUNK,
    scan: Scan = torch_scan,
) -> tuple[Tensor, Tensor]:
    """Gated delta rule over ``n`` positions, exact and differentiable (also w.r.t. ``initial_state``).

    q, k: ``[n, H, Dk]``; v: ``[n, H, Dv]``; g (log decay, <= 0), beta: ``[n, H]``; ``initial_state``
    ``[H, Dk, Dv]``. Returns the outputs ``[n, H, Dv]`` and the state after the last position ``[H, Dk, Dv]``."""
    n = k.shape[0]
    chunk = min(chunk, n)  # short inputs (decoding) need no padding to a full block; the result is the same
    out, state = scan(block_terms(q, k, v, g, beta, chunk), initial_state)
    return out.flatten(1, 2)[:, :n].transpose(0, 1), state


# --- dispatch -----------------------------------------------------------------------------------------------------

_FLA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CHOICE_ENV = "LONGSTRAW_DELTA_RULE"
CHOICES = ("auto", "triton", "torch")
_FLA_ON: dict[torch.device, Callable[..., Any] | None] = {}  # per device: fla's kernel, or None where it fails


def delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial: Tensor | None
) -> tuple[Tensor, Tensor]:
    """The gated delta rule as the mixer runs it (see the module's docstring for which path runs where)."""
    choice = kernel_choice()
    if choice == "auto" and q.is_cuda and not torch.is_grad_enabled() and q.dtype in _FLA_DTYPES:
        fla = fla_forward(q.device)
        if fla is not None:
            out, final = fla(
                q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
                initial_state=None if initial is None else initial.unsqueeze(0),
                output_final_state=True, use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            return out[0], final[0]
    return chunk_gated_delta_rule(q, k, v, g, beta, initial, scan=scan_for(q, choice))


def kernel_choice() -> str:
    """``LONGSTRAW_DELTA_RULE``'s value (``auto`` when unset); an unknown one is refused in one line."""
    choice = os.environ.get(CHOICE_ENV, "auto") or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{CHOICE_ENV}={choice!r}: choose one of {', '.join(CHOICES)}")
    return choice


def scan_for(q: Tensor, choice: str = "auto") -> Scan:
    """The Triton scan for CUDA tensors where Triton is installed and takes the dtype (fp32, fp64: the compute
    dtypes), unless ``choice`` is ``torch``; on the meta device (the planner's probes) the Triton scan's buffers
    alone (``meta_scan``); else the pure-torch scan."""
    if q.is_meta and choice != "torch":
        return meta_scan
    if choice != "torch" and q.is_cuda and triton_available() and q.dtype in (torch.float32, torch.float64):
        return triton_scan
    return torch_scan


class MetaScan(torch.autograd.Function):
    """The Triton scan on the meta device: every buffer its forward and backward make (``kernels.delta_terms``'
    ``forward_buffers``, ``backward_buffers``, the same functions the kernels' launches use), no work. It is what the
    planner simulates: a GPU runs this scan under autograd, and the pure-torch scan's Python loop over 64-position
    blocks was most of a plan's time (a 4,096-token chunk is 64 of them, per layer and walk)."""

    @staticmethod
    def forward(ctx: Any, *inputs: Tensor | None) -> tuple[Tensor, Tensor]:
        *parts, initial = inputs
        terms = BlockTerms(*(t.contiguous() for t in parts))  # type: ignore[union-attr]
        out, final, _ = forward_buffers(terms, save_states=False)
        ctx.save_for_backward(*terms, initial)
        return out, final

    @staticmethod
    def backward(ctx: Any, d_out: Tensor, d_final: Tensor | None) -> tuple[Tensor | None, ...]:
        *parts, initial = ctx.saved_tensors
        terms = BlockTerms(*parts)
        _, _, states = forward_buffers(terms, save_states=True)  # the states, recomputed for the gradients
        buffers = backward_buffers(terms)
        grads = buffers.grads()  # (the column blocks summed while the states are still held, as on a GPU)
        del states
        return (*grads, buffers.d_initial if initial is not None else None)


def meta_scan(terms: BlockTerms, initial: Tensor | None) -> tuple[Tensor, Tensor]:
    """``MetaScan``: the Triton scan's allocations on the meta device."""
    return MetaScan.apply(*terms, initial)


def triton_scan(terms: BlockTerms, initial: Tensor | None) -> tuple[Tensor, Tensor]:
    """The scan across blocks in Triton (``kernels.delta_scan``), differentiable in every term and in ``initial``."""
    from longstraw_agents.kernels.delta_scan import TritonScan

    return TritonScan.apply(*terms, initial)


def fla_forward(device: torch.device) -> Callable[..., Any] | None:
    """flash-linear-attention's ``chunk_gated_delta_rule`` where it is installed and runs a forward on ``device``
    (checked once per device; a failure is said once and leaves the Triton scan)."""
    if device not in _FLA_ON:
        _FLA_ON[device] = _working_fla(device)
    return _FLA_ON[device]


def _working_fla(device: torch.device) -> Callable[..., Any] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        return None
    try:
        with torch.no_grad():
            _fla_probe(fla_chunk, device)
    except Exception as err:  # whatever fla raises (its guards raise RuntimeError; Triton its own errors)
        warnings.warn(
            f"flash-linear-attention failed a forward on {device}, so GatedDeltaNet layers run the Triton scan "
            f"there: {type(err).__name__}: {err}",
            RuntimeWarning,
            stacklevel=3,
        )
        return None
    return fla_chunk


def _fla_probe(kernel: Callable[..., Any], device: torch.device, n: int = 2 * DELTA_CHUNK, dim: int = 64) -> None:
    """One forward of ``kernel`` on a small random input (bf16, one head), with an initial state."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, 1, dim, generator=gen).to(device, torch.bfloat16) for _ in range(3))
    g = -torch.rand(1, n, 1, generator=gen).to(device)
    beta = torch.rand(1, n, 1, generator=gen).to(device, torch.bfloat16)
    initial = torch.zeros(1, 1, dim, dim, device=device)
    kernel(q, k, v, g, beta, initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=True)


def delta_rule_flops(config: Any, new: int, chunk: int = DELTA_CHUNK) -> int:
    """Forward FLOPs of ``chunk_gated_delta_rule`` over ``new`` positions (padded to whole blocks of ``chunk``), per
    value head and position: the block's two score products (``4 C dk``), its two triangular solves
    (``C (dk + dv)``), the intra-block output (``2 C dv``) and three products with the ``dk x dv`` state."""
    if new == 0:
        return 0
    block = min(chunk, new)
    padded = -(-new // block) * block
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    per_position = block * (5 * dk + 3 * dv) + 6 * dk * dv
    return config.linear_num_value_heads * padded * per_position
