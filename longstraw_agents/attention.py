"""The attention core: a chunk's queries attend to a list of key/value blocks in ONE autograd node.

Everything long-context in the engine stands on this operation. The blocks are the captured state (one per stored
arena), the queries' own keys (causal), and — distributed — shards that live on other ranks. See DESIGN.md,
"Attention core".

Forward loops over the blocks, gets each block's partial result ``(out_b, lse_b)`` from a kernel and merges them
online by log-sum-exp (flash-decoding); it saves only the queries, the queries' own keys and values, the final
``out`` and ``lse``, and references to the blocks (which are the state, already held). Nothing per block is kept.
Backward recomputes each block with the *global* normaliser (``P_b = exp(S_b - lse)``, ``D = rowsum(dO ∘ out)``:
the ring-attention identity), which gives that block's ``dq, dk, dv`` exactly; ``dq`` sums over blocks. A block of
the captured state carries gradient *sinks*: its ``dk``/``dv`` are added in place into those buffers (slices of the
state's gradient) as backward reaches it, so no layer-sized gradient is ever returned through autograd. A block
without sinks gets no key/value gradient at all (detached mode), though the fused kernels compute one: every block
is taken in pieces of at most ``max_piece`` positions, so that their transient stays piece-sized.

Layouts: queries ``[n, H, D]``; keys ``[M, H_kv, D]`` and values ``[M, H_kv, Dv]`` (position first, as the state
stores them); ``H`` is a multiple of ``H_kv`` (grouped-query attention: query head ``h`` reads KV head
``h // (H / H_kv)``), never expanded into copies. Kernels see ``[1, heads, length, dim]`` views of these tensors.

Backends (``EngineConfig.attention``; ``"auto"`` picks the first that takes the shapes, in this order):

- ``cuda``: on CUDA, FlashAttention-2 or cuDNN per shape class, forward and backward apart, whichever ran faster on
  the class's first call with results equal to flash's (``TunedBackend``; torch checks no head counts for cuDNN).
- ``cuda-flash``: torch's FlashAttention-2 ops on CUDA (``aten._scaled_dot_product_flash_attention`` and its
  backward, which take the global ``out``/``lse``): fp16/bf16, ``D == Dv <= 256``. (The ``flash-attn`` package's own
  entry points change signature between releases; torch's ops run the same kernels.)
- ``cuda-cudnn``: torch's cuDNN attention ops (``aten._scaled_dot_product_cudnn_attention`` and its backward, which
  return and take the log-sum-exp too), on the same shapes.
- ``cpu-flash``: torch's fused CPU flash kernels (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
  ``_backward``): fp32, fp64, bf16, fp16 with ``D == Dv``; GQA natively; never materialises scores, so long blocks are
  never split in forward. For bf16/fp16 its backward is the eager math in fp32 (the fused one is ~5x slower there).
- ``eager``: matmul math (the oracle, and any shape: ``D != Dv``, any dtype), keys processed in pieces of at most
  ``max_score_elements`` scores.
- ``meta``: tensors on the meta device, for the memory planner: a fused kernel's allocations without arithmetic.
MLA's latent attention uses the same op with one KV head whose keys and values are the same stored rows (latent and
rope key side by side: the value's rope columns come out as extra output columns, dropped by the caller), so
``D == Dv`` holds and the fused kernels take it; on CUDA its head size (e.g. 576) exceeds what flash takes and the
eager backend runs.

``sparse_attend`` is the DeepSeek-sparse-attention form: each query attends to its own ``k`` selected positions,
gathered per block; its backward recomputes the gathers and probabilities (nothing score-sized is saved) and
scatter-adds the key/value gradients into the blocks' sinks.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

# Score elements (heads x query rows x keys) the eager backend materialises at most: longer key blocks are split
# into pieces, so the transient attention memory of a chunk is bounded by the chunk whatever the prefix length.
DEFAULT_SCORE_ELEMENTS = 1 << 20


def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics are kept in at least fp32 (bf16/fp16 models), in fp64 for fp64 models."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True, eq=False)
class KVBlock:
    """Keys ``[M, H_kv, D]`` and values ``[M, H_kv, Dv]`` every query may see, and optional gradient sinks: buffers
    of the same shapes into which this block's ``dk`` / ``dv`` are added during backward (None: not wanted)."""

    k: Tensor
    v: Tensor
    k_grad: Tensor | None = None
    v_grad: Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.k.shape[0])

    @property
    def wants_grad(self) -> bool:
        return self.k_grad is not None or self.v_grad is not None

    def piece(self, lo: int, hi: int) -> KVBlock:
        def cut(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[lo:hi]

        return KVBlock(self.k[lo:hi], self.v[lo:hi], cut(self.k_grad), cut(self.v_grad))


def as_heads(t: Tensor) -> Tensor:
    """``[L, heads, dim]`` → the kernels' ``[1, heads, L, dim]`` (a view)."""
    return t.transpose(0, 1).unsqueeze(0)


def from_heads(t: Tensor) -> Tensor:
    """``[1, heads, L, dim]`` → ``[L, heads, dim]`` (a view)."""
    return t[0].transpose(0, 1)


def merge(acc: tuple[Tensor, Tensor] | None, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over the union of two sets of keys from their partials ``(out [..., L, Dv], lse [..., L])``."""
    if acc is None:
        return out.to(lse.dtype), lse
    acc_out, acc_lse = acc
    total = torch.logaddexp(acc_lse, lse)
    # a row that sees no key on either side has -inf on both: weights 0, not exp(-inf - -inf) = nan
    w_acc = torch.exp(acc_lse - total).nan_to_num_(0.0).unsqueeze(-1)
    w_new = torch.exp(lse - total).nan_to_num_(0.0).unsqueeze(-1)
    return acc_out * w_acc + out.to(total.dtype) * w_new, total


class Shards(Protocol):
    """The ranks that hold a state's positions between them (context parallelism): each attends to its own blocks,
    and these collectives combine the results so that every rank gets the attention over all of them. Every rank
    calls them in the same order (the computation around them is replicated). ``longstraw_agents.parallel``
    implements it over a process group."""

    def merge_partials(
        self, acc: tuple[Tensor, Tensor] | None, out_shape: tuple[int, ...], lse: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The merge of every rank's ``(out, lse)`` partial (None: this rank holds none); ``lse`` gives the shape
        and dtype of a partial's normaliser, ``out_shape`` its output's."""
        ...

    def sum_(self, tensor: Tensor, kind: str) -> Tensor:
        """``tensor`` summed over the ranks, in place (``kind`` names the payload, for the transport's accounting)."""
        ...

    def merge_topk(
        self, running: tuple[Tensor, Tensor] | None, n: int, k: int, like: Tensor
    ) -> tuple[Tensor, Tensor] | None:
        """Every rank's best ``k`` (score, position) candidates per query, merged into the global best ``k`` (ties
        to the earlier position); ``like`` gives the scores' dtype and device."""
        ...


# --- backends -------------------------------------------------------------------------------------------------


class AttentionBackend(ABC):
    """One kernel family: a block's partial attention and its backward given the global ``out``/``lse``.

    Tensors are ``[1, heads, length, dim]`` (views of the position-first state; heads of K/V may divide the query
    heads). ``causal``: the block holds exactly the queries' own positions (square, top-left aligned)."""

    name: ClassVar[str]

    def __init__(self, max_score_elements: int = DEFAULT_SCORE_ELEMENTS):
        self.max_score_elements = max_score_elements  # what the eager math materialises at most

    @classmethod
    @abstractmethod
    def supports(cls, q: Tensor, k: Tensor, v: Tensor) -> bool: ...

    @abstractmethod
    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        """``(out [1, H, n, Dv] in q's dtype, lse [1, H, n] in softmax_dtype)``."""

    @abstractmethod
    def backward(
        self, d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of this block, for the attention whose output is ``out`` with log normaliser ``lse``."""


class EagerBackend(AttentionBackend):
    """Matmul math in softmax precision (fp32 for bf16/fp16 inputs), keys in pieces of at most
    ``max_score_elements`` scores."""

    name = "eager"

    @classmethod
    def supports(cls, q: Tensor, k: Tensor, v: Tensor) -> bool:
        return True

    def _pieces(self, q: Tensor, length: int) -> list[slice]:
        step = max(1, self.max_score_elements // max(q.shape[1] * q.shape[2], 1))
        return [slice(lo, min(lo + step, length)) for lo in range(0, length, step)]

    @staticmethod
    def _grouped(q: Tensor, kv_heads: int) -> Tensor:
        """``[1, H, n, D]`` → ``[H_kv, G, n, D]`` (a view): the query heads of one KV head together."""
        return q[0].unflatten(0, (kv_heads, -1))

    @staticmethod
    def _scores(qg: Tensor, k: Tensor, scale: float, hide: Tensor | None) -> Tensor:
        """Scaled scores ``[H_kv, G, n, m]`` in ``qg``'s dtype (the softmax dtype: CPUs multiply bf16 slowly)."""
        scores = torch.matmul(qg, k[0].transpose(-1, -2).unsqueeze(1).to(qg.dtype)) * scale
        return scores if hide is None else scores.masked_fill(hide, float("-inf"))

    @staticmethod
    def _hidden(n: int, piece: slice, length: int, device: torch.device) -> Tensor:
        """Causal mask of an own-block piece: key ``j`` is hidden from query ``i`` when ``j > i + (length - n)``."""
        keys = torch.arange(piece.start, piece.stop, device=device)
        return keys.unsqueeze(0) > torch.arange(n, device=device).unsqueeze(1) + (length - n)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        sdt = softmax_dtype(q.dtype)
        qg, n = self._grouped(q, k.shape[1]).to(sdt), q.shape[2]
        acc = None
        for piece in self._pieces(q, k.shape[2]):
            hide = self._hidden(n, piece, k.shape[2], q.device) if causal else None
            scores = self._scores(qg, k[:, :, piece], scale, hide)
            lse = torch.logsumexp(scores, dim=-1)  # -inf where a causal piece hides every key from a row
            probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
            out = torch.matmul(probs, v[0, :, piece].unsqueeze(1).to(sdt))  # [H_kv, G, n, Dv]
            acc = merge(acc, out, lse)
        assert acc is not None, "a block holds at least one key"
        out, lse = acc
        return out.flatten(0, 1).unsqueeze(0).to(q.dtype), lse.flatten(0, 1).unsqueeze(0)

    def backward(
        self, d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        kv_heads, sdt, n = k.shape[1], lse.dtype, q.shape[2]
        qg = self._grouped(q, kv_heads).to(sdt)
        d_og = self._grouped(d_out, kv_heads).to(sdt)
        lse_g = lse[0].unflatten(0, (kv_heads, -1)).unsqueeze(-1)
        row = (d_og * self._grouped(out, kv_heads).to(sdt)).sum(-1, keepdim=True)  # D = rowsum(dO ∘ out)
        dq = torch.zeros(qg.shape, dtype=sdt, device=q.device)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        for piece in self._pieces(q, k.shape[2]):
            hide = self._hidden(n, piece, k.shape[2], q.device) if causal else None
            kp, vp = k[0, :, piece].unsqueeze(1).to(sdt), v[0, :, piece].unsqueeze(1).to(sdt)
            probs = torch.exp(self._scores(qg, k[:, :, piece], scale, hide) - lse_g)  # hidden keys: exactly 0
            dv[0, :, piece] = torch.matmul(probs.transpose(-1, -2), d_og).sum(1).to(v.dtype)
            d_scores = probs * (torch.matmul(d_og, vp.transpose(-1, -2)) - row) * scale
            dq += torch.matmul(d_scores, kp)
            dk[0, :, piece] = torch.matmul(d_scores.transpose(-1, -2), qg).sum(1).to(k.dtype)
        return dq.flatten(0, 1).unsqueeze(0).to(q.dtype), dk, dv


class CpuFlashBackend(AttentionBackend):
    """torch's fused flash-attention kernels for CPU, which return the log-sum-exp and take it back in backward.

    For bf16/fp16 the fused CPU backward is ~5x slower than matmul math in fp32 (bench/attention.py), so those
    dtypes take the fused forward and the eager backward (the same gradient: both use the global ``out``/``lse``).
    """

    name = "cpu-flash"
    DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    FUSED_BACKWARD_DTYPES = (torch.float32, torch.float64)
    # Queries per piece of a long causal block in forward. The fused kernel computes the masked half of a causal
    # block whose keys fit one of its key tiles (measured on 512 keys: a causal block costs as much as a full one);
    # in pieces, each piece's earlier keys are a full block and only its own square is causal (~0.7x the time).
    CAUSAL_PIECE = 256

    def __init__(self, max_score_elements: int = DEFAULT_SCORE_ELEMENTS):
        super().__init__(max_score_elements)
        self.eager = EagerBackend(max_score_elements)

    @classmethod
    def supports(cls, q: Tensor, k: Tensor, v: Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype in cls.DTYPES and q.shape[-1] == k.shape[-1] == v.shape[-1]

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        if causal and q.shape[2] > self.CAUSAL_PIECE:
            return self._causal_in_pieces(q, k, v, scale)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse

    def _causal_in_pieces(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        outs, lses = [], []
        for lo in range(0, q.shape[2], self.CAUSAL_PIECE):
            hi = min(lo + self.CAUSAL_PIECE, q.shape[2])
            qp = q[:, :, lo:hi]
            part = self.forward(qp, k[:, :, lo:hi], v[:, :, lo:hi], True, scale)
            if lo:
                part = merge(self.forward(qp, k[:, :, :lo], v[:, :, :lo], False, scale), *part)
            outs.append(part[0].to(q.dtype))
            lses.append(part[1])
        return torch.cat(outs, dim=2), torch.cat(lses, dim=2)

    def backward(
        self, d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        if q.dtype not in self.FUSED_BACKWARD_DTYPES:
            return self.eager.backward(d_out, q, k, v, out, lse, causal, scale)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            d_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return grads[0], grads[1], grads[2]


class CudaFlashBackend(AttentionBackend):
    """torch's FlashAttention-2 ops on CUDA (fp16/bf16, equal head sizes up to 256, GQA natively)."""

    name = "cuda-flash"
    DTYPES = (torch.float16, torch.bfloat16)
    MAX_HEAD_DIM = 256

    @classmethod
    def supports(cls, q: Tensor, k: Tensor, v: Tensor) -> bool:
        d = q.shape[-1]
        return (
            q.is_cuda
            and q.dtype in cls.DTYPES
            and d == k.shape[-1] == v.shape[-1]
            and d <= cls.MAX_HEAD_DIM
            and d % 8 == 0
        )

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        result = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        return result[0], result[1]

    def backward(
        self, d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        # None reaches the op as an undefined tensor, as the forward returns them without dropout or packed
        # sequences (a defined empty tensor would select the variable-length kernel)
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            d_out.contiguous(), q, k, v, out, lse.float(), None, None, q.shape[2], k.shape[2], 0.0, causal,
            None, None, scale=scale,
        )  # fmt: skip
        return grads[0], grads[1], grads[2]


class CudaCudnnBackend(CudaFlashBackend):
    """torch's cuDNN attention ops on CUDA (``aten._scaled_dot_product_cudnn_attention`` and its backward), which
    return the log-sum-exp (``[1, H, n, 1]``) and take the global one back. Faster than FlashAttention-2 on Hopper at
    some shapes; torch itself prefers it there. torch checks no head counts for it, so the ``cuda`` backend takes it
    only where its results matched flash's at the shape (``TunedBackend``)."""

    name = "cuda-cudnn"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
        return result[0], result[1].squeeze(-1)

    def backward(
        self, d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        seed = torch.zeros((), dtype=torch.long, device=q.device)  # no dropout: the generator state is not read
        grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            d_out.contiguous(), q, k, v, out, lse.float().unsqueeze(-1).contiguous(), seed, seed, None, None, None,
            q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )  # fmt: skip
        return grads[0], grads[1], grads[2]


@dataclass(frozen=True)
class ShapeClass:
    """What a kernel's speed depends on: dtype, heads, head size, causality and the lengths' power-of-two classes."""

    device: torch.device
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    queries: int
    keys: int

    @classmethod
    def of(cls, q: Tensor, k: Tensor, causal: bool) -> ShapeClass:
        def power(n: int) -> int:
            return 1 << max(n - 1, 0).bit_length()

        return cls(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1], causal, power(q.shape[2]), power(k.shape[2]))


class TunedBackend(AttentionBackend):
    """The fastest of ``CANDIDATES`` at each shape class, forward and backward chosen apart, by measurement on the
    first call of the class (as cuDNN's own benchmark mode): every candidate runs the call once untimed, then
    ``REPEATS`` times timed (the median counts), and one whose results differ from the first candidate's (the
    reference) beyond ``TOLERANCE``, or that raises, is never chosen for the class; another must beat the reference
    by ``MARGIN``, so that timing noise does not flip a choice between near-equal kernels (ranks that replicate a
    computation choose alike). Both directions keep the attention core's contract, so a forward by one kernel and a
    backward by another give the same gradient. The choices are shared by every instance (``choices``); while a CUDA
    graph is being captured nothing is measured and the reference runs."""

    CANDIDATES: ClassVar[tuple[type[AttentionBackend], ...]]
    TOLERANCE: ClassVar[float] = 2e-2  # relative, of a bf16 result against the reference kernel's
    REPEATS: ClassVar[int] = 3
    MARGIN: ClassVar[float] = 0.95  # another kernel is chosen when its time is below this share of the reference's
    choices: ClassVar[dict[tuple[str, ShapeClass], type[AttentionBackend]]]

    def __init__(self, max_score_elements: int = DEFAULT_SCORE_ELEMENTS):
        super().__init__(max_score_elements)
        self.kernels = [candidate(max_score_elements) for candidate in self.CANDIDATES]

    @classmethod
    def supports(cls, q: Tensor, k: Tensor, v: Tensor) -> bool:
        return cls.CANDIDATES[0].supports(q, k, v)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        return self._chosen("forward", ShapeClass.of(q, k, causal), (q, k, v, causal, scale))

    def backward(
        self, d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        return self._chosen("backward", ShapeClass.of(q, k, causal), (d_out, q, k, v, out, lse, causal, scale))

    def _chosen(self, direction: str, shape: ShapeClass, args: tuple) -> Any:
        key = (direction, shape)
        chosen = self.choices.get(key)
        if chosen is None:
            if self._capturing():
                return getattr(self.kernels[0], direction)(*args)
            chosen = self.choices[key] = self._measure(direction, args)
        kernel = next(k for k in self.kernels if type(k) is chosen)
        return getattr(kernel, direction)(*args)

    def _measure(self, direction: str, args: tuple) -> type[AttentionBackend]:
        """The candidate that ran the call fastest among those whose results matched the reference's."""
        reference = getattr(self.kernels[0], direction)(*args)
        best = type(self.kernels[0])
        best_seconds = self.MARGIN * self.seconds(self.kernels[0], direction, args)
        for kernel in self.kernels[1:]:
            try:
                result = getattr(kernel, direction)(*args)
                if not _close(result, reference, self.TOLERANCE):
                    continue
                elapsed = self.seconds(kernel, direction, args)
            except RuntimeError:  # a shape or dtype the kernel refuses at run time
                continue
            if elapsed < best_seconds:
                best, best_seconds = type(kernel), elapsed
        return best

    def seconds(self, kernel: AttentionBackend, direction: str, args: tuple) -> float:
        """The median time of ``REPEATS`` calls of ``kernel``'s ``direction`` (the device synchronised around each)."""
        times = []
        for _ in range(self.REPEATS):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            getattr(kernel, direction)(*args)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    @staticmethod
    def _capturing() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _close(got: tuple[Tensor, ...], want: tuple[Tensor, ...], tolerance: float) -> bool:
    def relative(a: Tensor, b: Tensor) -> float:
        scale = b.double().norm()
        return float((a.double() - b.double()).norm() / scale) if scale > 0 else float(a.double().norm())

    return all(a.shape == b.shape and relative(a, b) <= tolerance for a, b in zip(got, want, strict=True))


class CudaTunedBackend(TunedBackend):
    """On CUDA: FlashAttention-2 or cuDNN, whichever was faster at the shape class with equal results (``auto``'s
    choice on a GPU)."""

    name = "cuda"
    CANDIDATES = (CudaFlashBackend, CudaCudnnBackend)
    choices: ClassVar[dict[tuple[str, ShapeClass], type[AttentionBackend]]] = {}


class MetaBackend(AttentionBackend):
    """Tensors on the meta device (the memory planner): a fused kernel's allocations — its outputs and gradients,
    never scores — with no arithmetic."""

    name = "meta"

    @classmethod
    def supports(cls, q: Tensor, k: Tensor, v: Tensor) -> bool:
        return q.device.type == "meta"

    def forward(self, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        return out, q.new_empty(q.shape[:-1], dtype=softmax_dtype(q.dtype))

    def backward(
        self, d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b
    for b in (CudaTunedBackend, CudaFlashBackend, CudaCudnnBackend, CpuFlashBackend, MetaBackend, EagerBackend)
}
BACKEND_NAMES = ("auto", *BACKENDS)


# --- the op ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Attention:
    """How the engine runs attention: the backend (a name of ``BACKENDS``, or ``"auto"``), the eager backend's score
    budget, and the most positions of a block whose key/value gradient is computed at once in backward (the engine
    uses its chunk size: the transient is then smaller than the chunk's own graph)."""

    backend: str = "auto"
    max_score_elements: int = DEFAULT_SCORE_ELEMENTS
    max_piece: int = 1 << 16
    shards: Shards | None = field(default=None, compare=False)  # context parallelism: other ranks' blocks
    exact_products: bool = False  # DSA's kernels: fp32 products (tests); else bf16 tensor cores, fp32 sums

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"unknown attention backend {self.backend!r}; choose one of {list(BACKEND_NAMES)}")

    def kernel(self, q: Tensor, k: Tensor, v: Tensor) -> AttentionBackend:
        """The backend for these (kernel-layout) shapes: the named one, or under "auto" the first that takes them."""
        if self.backend != "auto":
            chosen = BACKENDS[self.backend]
            if not chosen.supports(q, k, v):
                raise ValueError(
                    f"attention backend {self.backend!r} cannot take {q.dtype} on {q.device.type} with head sizes "
                    f"q/k {q.shape[-1]}, v {v.shape[-1]}; use 'auto' or 'eager'"
                )
            return self._build(chosen)
        return self._build(next(b for b in BACKENDS.values() if b.supports(q, k, v)))

    def _build(self, backend: type[AttentionBackend]) -> AttentionBackend:
        return backend(self.max_score_elements)

    def __call__(self, q: Tensor, blocks: Sequence[KVBlock], own_k: Tensor, own_v: Tensor, scale: float) -> Tensor:
        """Causal attention of ``q [n, H, D]`` over ``blocks`` (all visible) and its own keys/values ``[n, H_kv, *]``
        (the last ``n`` positions, causal). Returns ``[n, H, Dv]``; one autograd node."""
        blocks = [b for b in blocks if b.length]
        out: Tensor = _BlockAttention.apply(q, own_k, own_v, blocks, scale, self)
        return out


def partial_attention(
    q: Tensor, blocks: Sequence[KVBlock], attention: Attention, scale: float
) -> tuple[Tensor, Tensor]:
    """Forward only, no autograd: ``(out [n, H, Dv], lse [n, H])`` of ``q [n, H, D]`` over ``blocks``, every key
    visible to every query — the piece decoding composes (e.g. the G members' queries stacked over their shared
    prompt in one kernel call, then each member's own blocks, merged with ``merge``)."""
    q4, acc = as_heads(q), None
    with torch.no_grad():
        for block in blocks:
            if block.length:
                k4, v4 = as_heads(block.k), as_heads(block.v)
                acc = merge(acc, *attention.kernel(q4, k4, v4).forward(q4, k4, v4, False, scale))
    if acc is None:
        raise ValueError("partial_attention needs at least one non-empty block")
    out, lse = acc
    return from_heads(out), lse[0].transpose(0, 1)


class _BlockAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: Tensor, own_k: Tensor, own_v: Tensor, blocks: list[KVBlock], scale: float, attention: Attention
    ) -> Tensor:
        q4 = as_heads(q)
        acc = None
        for block in blocks:
            k4, v4 = as_heads(block.k), as_heads(block.v)
            acc = merge(acc, *attention.kernel(q4, k4, v4).forward(q4, k4, v4, False, scale))
        k4, v4 = as_heads(own_k), as_heads(own_v)
        own_out, own_lse = attention.kernel(q4, k4, v4).forward(q4, k4, v4, True, scale)
        if attention.shards is not None:  # the other ranks' blocks
            acc = attention.shards.merge_partials(acc, tuple(own_out.shape[:-1]) + (own_v.shape[-1],), own_lse)
        out, lse = merge(acc, own_out, own_lse)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, own_k, own_v, out, lse)
        ctx.blocks, ctx.scale, ctx.attention = blocks, scale, attention
        return from_heads(out)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        q, own_k, own_v, out, lse = ctx.saved_tensors
        attention: Attention = ctx.attention
        q4, d_out4 = as_heads(q), as_heads(d_out).contiguous()
        dq = torch.zeros(q4.shape, dtype=lse.dtype, device=q.device)
        for block in ctx.blocks:
            # in pieces, with sinks or not: the fused kernel returns a piece's dK/dV whether it is kept or not, and
            # a whole block's (a long prompt's share) would be a transient the size of its state's layer
            for lo in range(0, block.length, attention.max_piece):
                piece = block.piece(lo, lo + attention.max_piece)
                k4, v4 = as_heads(piece.k), as_heads(piece.v)
                dq_b, dk, dv = attention.kernel(q4, k4, v4).backward(d_out4, q4, k4, v4, out, lse, False, ctx.scale)
                dq += dq_b
                if piece.k_grad is not None:
                    piece.k_grad.add_(from_heads(dk))
                if piece.v_grad is not None:
                    piece.v_grad.add_(from_heads(dv))
        if attention.shards is not None:  # every rank's blocks add to the queries' gradient
            attention.shards.sum_(dq, "dq")
        k4, v4 = as_heads(own_k), as_heads(own_v)
        dq_o, dk, dv = attention.kernel(q4, k4, v4).backward(d_out4, q4, k4, v4, out, lse, True, ctx.scale)
        dq += dq_o
        return from_heads(dq).to(q.dtype), from_heads(dk), from_heads(dv), None, None, None


# --- DeepSeek sparse attention ------------------------------------------------------------------------------------


def sparse_attend(
    q: Tensor,
    blocks: Sequence[Tensor],
    sinks: Sequence[Tensor | None],
    own: Tensor,
    selected: Tensor,
    start: int,
    scale: float,
    offsets: Sequence[int] | None = None,
    attention: Attention | None = None,
) -> Tensor:
    """Each query attends to its own selected positions only (DSA), with keys and values the same rows.

    q: ``[n, H, W]``; blocks: the earlier rows ``[M_b, W]`` in position order, starting at ``offsets`` (default:
    back to back from position 0), with ``sinks`` (gradient buffers of the same shapes, or None); own: the queries'
    own rows ``[n, W]`` (positions ``start..``); selected: global positions ``[n, k]`` per query (only those ``<=``
    the query's position count); ``attention``: its shards (the other ranks holding the rest of the earlier rows),
    its budget of gathered elements and its products' precision. Returns ``[n, H, W]``; nothing score-sized is
    saved for backward.

    On a GPU one Triton kernel per span of rows reads each query's selected rows where they are stored
    (``kernels.sparse_attention``) and the spans' partials merge by log-sum-exp. Elsewhere the selected rows are
    gathered for a block of queries at a time, at most ``max_score_elements`` of them (in elements: queries x k x
    W), and attended in one softmax."""
    attention = attention if attention is not None else Attention()
    if offsets is None:
        offsets = [sum(b.shape[0] for b in blocks[:i]) for i in range(len(blocks))]
    spans = [(rows, offset, sink) for rows, offset, sink in zip(blocks, offsets, sinks, strict=True)]
    out: Tensor = _SparseAttention.apply(q, own, spans, selected, start, scale, attention)
    return out


def sparse_kernel_applies(q: Tensor, spans: Sequence[Span]) -> bool:
    """The Triton sparse kernel runs here: CUDA tensors in a dtype it takes, Triton installed and the DSA kernels not
    switched off (``kernels.dsa_kernels_on``), and every gradient sink at least fp32 (atomic adds)."""
    sinks_ok = all(sink is None or sink.dtype in (torch.float32, torch.float64) for _, _, sink in spans)
    return q.is_cuda and q.dtype in (torch.bfloat16, torch.float16, torch.float32) and sinks_ok and _dsa_kernels()


def _dsa_kernels() -> bool:
    from longstraw_agents.kernels import dsa_kernels_on

    return dsa_kernels_on()


Span = tuple[Tensor, int, "Tensor | None"]  # rows, their first position, their gradient sink


@dataclass(frozen=True)
class _Gathered:
    """The selected rows of a sparse attention, gathered from the spans that hold them.

    rows: ``[n, k, W]``; visible: ``[n, k]`` the slots a query attends to (a position held here, and not after the
    query: a slot no span holds — another rank's position, or padding — has some finite row and is never visible);
    own: the slots of the queries' own rows. The longest span is gathered for every slot at once, then the slots the
    other spans hold are overwritten: one pass over the ``n x k`` rows, whatever the spans' lengths and number."""

    rows: Tensor
    visible: Tensor
    own: Tensor

    @classmethod
    def of(
        cls, spans: Sequence[Span], own: Tensor, selected: Tensor, start: int, first: int, dtype: torch.dtype
    ) -> _Gathered:
        """The rows ``selected [b, k]`` by the queries at positions ``first..first+b`` (own rows from ``start``)."""
        sources = [(block, offset) for block, offset, _ in spans if block.shape[0]] + [(own, start)]
        flat = selected.flatten()
        held = torch.zeros_like(flat, dtype=torch.bool)
        for block, offset in sources:
            held |= (flat >= offset) & (flat < offset + block.shape[0])
        longest, longest_start = max(sources, key=lambda source: source[0].shape[0])
        rows = longest.index_select(0, (flat - longest_start).clamp(0, longest.shape[0] - 1)).to(dtype)
        for block, offset in sources:
            if block is not longest:
                slots, index = _placed(flat, block.shape[0], offset)
                rows.index_copy_(0, slots, block.index_select(0, index).to(dtype))
        query_pos = torch.arange(first, first + selected.shape[0], device=selected.device).unsqueeze(1)
        visible = held.view(selected.shape) & (selected <= query_pos)
        return cls(rows.view(*selected.shape, -1), visible, selected >= start)

    def scores(self, q: Tensor, scale: float) -> Tensor:
        """``[n, H, k]`` scaled scores of queries ``q [n, H, W]`` over their rows."""
        return torch.matmul(q, self.rows.transpose(1, 2)) * scale


def _placed(flat: Tensor, length: int, offset: int) -> tuple[Tensor, Tensor]:
    """The slots of ``flat`` (selected positions) that rows ``[offset, offset + length)`` hold, and their rows
    there. On the meta device (the memory planner) there are no positions to read: every slot, as if the rows held
    all of them (an upper bound on what a gather of them allocates)."""
    relative = flat - offset
    if flat.device.type == "meta":
        return torch.arange(flat.shape[0], device=flat.device), relative.clamp(0, max(length - 1, 0))
    slots = ((relative >= 0) & (relative < length)).nonzero().squeeze(1)
    return slots, relative[slots]


def _sparse_partial(q: Tensor, gathered: _Gathered, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(out [n, H, W], lse [n, H])`` of ``q`` over its ``visible`` gathered rows (lse -inf where none)."""
    return selected_partial(q, gathered.rows, visible, scale)


def selected_partial(q: Tensor, rows: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """``(out [n, H, W], lse [n, H])`` of queries ``q [n, H, W]`` over their ``visible [n, k]`` rows
    ``[n, k, W]`` (keys and values at once, as DSA reads them), in softmax precision; lse -inf where none is."""
    sdt = softmax_dtype(q.dtype)
    rows = rows.to(sdt)
    scores = torch.matmul(q.to(sdt), rows.transpose(1, 2)) * scale
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)
    return torch.matmul(probs, rows), lse


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        own: Tensor,
        spans: list[Span],
        selected: Tensor,
        start: int,
        scale: float,
        attention: Attention,
    ) -> Tensor:
        call = _SparseCall.of(q, own, spans, selected, start, scale, attention)
        earlier, own_part = call.partials()
        if attention.shards is None:
            out, lse = merge(earlier, *own_part)
        else:  # the earlier rows of every rank, then the own rows (which every rank holds) once
            like = own_part[1]
            acc = attention.shards.merge_partials(earlier, tuple(own_part[0].shape), like)
            out, lse = merge(acc, *own_part)
        ctx.save_for_backward(q, own, selected, out, lse)
        ctx.spans, ctx.start, ctx.scale, ctx.attention = spans, start, scale, attention
        return out.to(q.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, d_out: Tensor) -> tuple[Tensor | None, ...]:
        q, own, selected, out, lse = ctx.saved_tensors
        attention: Attention = ctx.attention
        call = _SparseCall.of(q, own, ctx.spans, selected, ctx.start, ctx.scale, attention)
        d_own = torch.zeros(own.shape, dtype=lse.dtype, device=own.device)
        d_earlier, d_q_own = call.grads(out, lse, d_out, d_own)
        if attention.shards is not None:  # every rank's earlier rows add to the queries' gradient; the own rows once
            d_earlier = attention.shards.sum_(d_earlier, "dq")
        return (d_earlier + d_q_own).to(q.dtype), d_own.to(own.dtype), None, None, None, None, None


Partial = tuple[Tensor, Tensor]


@dataclass(frozen=True)
class _SparseCall(ABC):
    """One sparse attention's inputs (``sparse_attend``'s), and its two directions, each as partials: the earlier
    spans' (merged over the ranks by the caller) and the own rows'. ``of`` picks the path: the Triton kernels where
    ``sparse_kernel_applies``, else the selected rows gathered a block of queries at a time."""

    q: Tensor
    own: Tensor
    spans: Sequence[Span]
    selected: Tensor
    start: int
    scale: float
    attention: Attention

    @staticmethod
    def of(
        q: Tensor,
        own: Tensor,
        spans: Sequence[Span],
        selected: Tensor,
        start: int,
        scale: float,
        attention: Attention,
    ) -> _SparseCall:
        path = _KernelSparse if sparse_kernel_applies(q, spans) else _GatheredSparse
        return path(q, own, spans, selected, start, scale, attention)

    @abstractmethod
    def partials(self) -> tuple[Partial | None, Partial]:
        """The earlier spans' merged partial (None: none, or none apart from the own rows') and the own rows'."""

    @abstractmethod
    def grads(self, out: Tensor, lse: Tensor, d_out: Tensor, d_own: Tensor) -> tuple[Tensor, Tensor]:
        """The queries' gradient from the earlier spans and from the own rows, for the attention whose (global)
        output is ``out`` with log normaliser ``lse``; the rows' gradients added into the spans' sinks and
        ``d_own``."""


class _KernelSparse(_SparseCall):
    """The Triton kernels (``kernels.sparse_attention``): one call per span, each query's rows read in place."""

    @property
    def _constants(self) -> tuple[int, float, bool]:
        return _split(self.q.shape[-1]), self.scale, _fast(self.q, self.attention)

    def partials(self) -> tuple[Partial | None, Partial]:
        from longstraw_agents.kernels.sparse_attention import sparse_forward

        q, selected, start = self.q, self.selected, self.start
        earlier: Partial | None = None
        for rows, offset, _ in self.spans:
            if rows.shape[0]:
                earlier = merge(earlier, *sparse_forward(q, rows, selected, offset, start, *self._constants))
        return earlier, sparse_forward(q, self.own, selected, start, start, *self._constants)

    def grads(self, out: Tensor, lse: Tensor, d_out: Tensor, d_own: Tensor) -> tuple[Tensor, Tensor]:
        from longstraw_agents.kernels.sparse_attention import sparse_backward

        def span(rows: Tensor, offset: int, sink: Tensor | None) -> Tensor:
            return sparse_backward(
                self.q, rows, self.selected, offset, self.start, *self._constants, out, lse, d_out, sink
            )

        d_earlier = torch.zeros(out.shape, dtype=out.dtype, device=out.device)
        for rows, offset, sink in self.spans:
            if rows.shape[0]:
                d_earlier += span(rows, offset, sink)
        return d_earlier, span(self.own, self.start, d_own)


class _GatheredSparse(_SparseCall):
    """The selected rows gathered for a block of queries at a time, at most ``max_score_elements`` of them (queries
    x k x width), and attended in one softmax; their gradients added into the sinks with ``index_add_``."""

    def _blocks(self) -> Iterator[tuple[slice, _Gathered]]:
        n, k = self.selected.shape
        step = max(1, self.attention.max_score_elements // max(k * self.q.shape[-1], 1))
        dtype = softmax_dtype(self.q.dtype)
        for lo in range(0, n, step):
            block = slice(lo, min(lo + step, n))
            yield block, _Gathered.of(self.spans, self.own, self.selected[block], self.start, self.start + lo, dtype)

    def partials(self) -> tuple[Partial | None, Partial]:
        """In one process, one softmax over every visible row: no earlier partial."""
        qs = self.q.to(softmax_dtype(self.q.dtype))
        apart = self.attention.shards is not None
        outs = [qs.new_zeros(qs.shape) for _ in range(1 + apart)]
        lses = [qs.new_full(qs.shape[:-1], float("-inf")) for _ in range(1 + apart)]
        for block, gathered in self._blocks():
            masks = [gathered.visible & gathered.own, gathered.visible & ~gathered.own] if apart else [gathered.visible]
            for out, lse, visible in zip(outs, lses, masks, strict=True):
                out[block], lse[block] = _sparse_partial(qs[block], gathered, visible, self.scale)
        return ((outs[1], lses[1]) if apart else None), (outs[0], lses[0])

    def grads(self, out: Tensor, lse: Tensor, d_out: Tensor, d_own: Tensor) -> tuple[Tensor, Tensor]:
        sdt, scale = lse.dtype, self.scale
        qs, d_o = self.q.to(sdt), d_out.to(sdt)
        d_earlier, d_q_own = torch.zeros(out.shape, dtype=sdt, device=out.device), torch.zeros_like(out, dtype=sdt)
        row = (d_o * out).sum(-1, keepdim=True)  # D = rowsum(dO ∘ out) [n, H, 1]
        for block, gathered in self._blocks():
            probs = torch.exp(gathered.scores(qs[block], scale) - lse[block].unsqueeze(-1))
            probs = probs.masked_fill(~gathered.visible.unsqueeze(1), 0.0)  # hidden slots: exact zeros, no sync
            d_scores = probs * (torch.matmul(d_o[block], gathered.rows.transpose(1, 2)) - row[block]) * scale
            if self.attention.shards is None:  # (the sum is all the caller needs)
                d_earlier[block] = torch.matmul(d_scores, gathered.rows)
            else:
                own_slots = gathered.own.unsqueeze(1)
                d_earlier[block] = torch.matmul(d_scores.masked_fill(own_slots, 0.0), gathered.rows)
                d_q_own[block] = torch.matmul(d_scores.masked_fill(~own_slots, 0.0), gathered.rows)
            # each row is a key and a value at once: its gradient sums both parts, per selected slot [b * k, W]
            d_rows = torch.matmul(d_scores.transpose(1, 2), qs[block]) + torch.matmul(probs.transpose(1, 2), d_o[block])
            d_rows = d_rows.flatten(0, 1)
            for rows, offset, sink in (*self.spans, (self.own, self.start, d_own)):
                if sink is not None:
                    slots, index = _placed(self.selected[block].flatten(), rows.shape[0], offset)
                    sink.index_add_(0, index, d_rows.index_select(0, slots).to(sink.dtype))
        return d_earlier, d_q_own


def _fast(q: Tensor, attention: Attention) -> bool:
    """The kernels multiply on bf16 tensor cores: a half-precision model (its rows and queries are bf16 values, so
    nothing is rounded that was not already), unless ``exact_products`` asks for fp32."""
    return q.dtype in (torch.bfloat16, torch.float16) and not attention.exact_products


def _split(width: int) -> int:
    """Where the kernels cut a row in two power-of-two tiles: MLA's 512 latent + 64 rope columns."""
    return 1 << (width.bit_length() - 1)
