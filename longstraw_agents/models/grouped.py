"""Grouped matmuls: rows sorted by group, each group's rows through that group's own weight — a mixture of experts'
routed experts as one kernel per projection, forward and backward, with no host sync.

``grouped_linear(rows, weight, groups)`` is ``F.linear(rows[r], weight[g])`` for every row ``r`` of group ``g``:
``rows [R, in]`` sorted by group, ``weight [G, out, in]`` stacked (``F.linear``'s layout, as transformers stacks
``gate_up_proj`` and ``down_proj``), ``groups`` where each group ends (``Groups``, on the device). Rows past the
last group are in none: their products and their gradient are zeros (expert parallelism's share of a rank: the
slots of other ranks' experts sort last). One autograd node per call saves the rows and the weight, as ``F.linear``
does, whatever the kernel; its backward is two more grouped products (the rows' gradient, the weights').

The kernels, one class each (``kernel_for`` picks):

- ``TorchGroupedMM``: torch's ``_grouped_mm`` (``torch.nn.functional.grouped_mm`` in torch >= 2.10). No padding and
  no host sync, where its fast path runs: bf16 on Hopper (compute capability 9). Elsewhere on CUDA torch falls back
  to a loop of matmuls that reads the offsets on the host (torch 2.11's ``_grouped_mm_fallback``), and on Blackwell
  (10.x) its weight gradient is wrong for a group without rows (pytorch#172439), so CUDA takes it on Hopper only. On
  CPU its loop takes fp32, bf16 and fp16 without a device sync. Its operands' strides must be multiples of 16 bytes:
  ``in`` and ``out`` multiples of 8 in bf16 (4 in fp32); other widths take the padded kernel.
- ``PaddedBmm``: everywhere else (fp64, fp32 on a GPU, GPUs other than Hopper). Each group's rows are padded to a
  common capacity and one ``bmm`` runs over the stacked weights; the padding's rows are zeros, so they add nothing
  to the weights' gradient. The capacity is where memory goes: padding every group to the most rows any group can
  hold (``Groups.most``: a MoE's tokens, since a token takes an expert once) needs no host sync, but allocates
  ``G x most`` rows. For GLM-5.2 (256 experts, hidden 6,144, experts 2,048 wide, top-8) at a 4,096-token chunk that
  is 1M rows where 32,768 are real: 12 GiB of padded input and 8 GiB of padded hidden activations in bf16, where
  the grouped kernel holds 384 and 256 MiB. So the static capacity is used only while ``G x most`` is within
  ``PADDED_ROWS`` (or twice the real rows): decoding's small batches (up to 64 tokens for GLM-5.2), the tests' tiny
  models — no host sync there. Past it the kernel reads the largest group's rows on the host, once per ``Groups``
  (a MoE call's two projections and its backward share it), pads to that (rounded up to a power of two, so that
  few shapes recur) and runs the groups in as few ``bmm`` calls as keep the padded rows within the same bound: one
  where routing is near even; at worst, every token on one expert, ``G / 2k`` calls (16 for GLM-5.2). That path
  syncs and is not graphable; on Hopper in bf16 the grouped kernel runs instead.
- ``ShapesOnly``: on the meta device (the memory planner): the grouped kernel's allocations, no arithmetic.

``LONGSTRAW_GROUPED_MM`` (read at each call) narrows the choice: ``padded`` runs the padded kernel everywhere (for
comparisons, and for a GPU where torch's kernel failed its parity test, ``bench/gpu.sh``); ``auto`` (the default) is
as above.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import _disable_current_modes

PADDED_ROWS = 16_384  # padded rows a bmm may hold beyond twice the real ones (a group's rows padded to a capacity)
ALIGNMENT = 16  # bytes: torch's grouped kernels take strides (and, on CUDA, data pointers) in multiples of this
CHOICE_ENV = "LONGSTRAW_GROUPED_MM"
CHOICES = ("auto", "padded")


class Groups:
    """How ``rows`` rows sorted by group fall into ``len(ends)`` groups: group ``g`` holds rows ``ends[g - 1]`` to
    ``ends[g]`` (from 0; ``ends`` int64 on the rows' device, read on the host only by the padded kernel past its
    budget). ``most`` bounds the rows of any group without reading ``ends`` (the padded kernel's capacity without a
    host sync).
    ``partial``: rows may lie past the last group (in none)."""

    def __init__(self, ends: Tensor, rows: int, most: int, partial: bool):
        self.ends, self.rows, self.most, self.partial = ends, rows, most, partial
        self._padding: list[_Padding] | None = None

    @property
    def count(self) -> int:
        return len(self.ends)

    @functools.cached_property
    def offsets(self) -> Tensor:
        """``ends`` as torch's grouped kernels take them (int32)."""
        return self.ends.to(torch.int32)

    def masked(self, product: Tensor) -> Tensor:
        """``product [rows, ...]`` with the rows in no group zeroed (torch's kernel leaves them unwritten)."""
        if not self.partial:
            return product
        inside = torch.arange(self.rows, device=product.device) < self.ends[-1]
        return torch.where(inside[:, None], product, 0)

    def padding(self) -> list[_Padding]:
        """The padded kernel's ``bmm`` calls: groups, capacity, and where each row goes (see the module's
        docstring: the largest group read on the host where ``most`` would pad too much; once per ``Groups``)."""
        if self._padding is None:
            budget = max(PADDED_ROWS, 2 * self.rows)
            if self.count * self.most <= budget:
                capacity, per_call = max(self.most, 1), self.count
            else:  # (a host sync: the bound is not affordable)
                largest = int((self.ends - _starts(self.ends)).max())
                capacity = max(1, min(self.most, 1 << max(largest - 1, 0).bit_length()))
                per_call = max(1, budget // capacity)
            group, position = self._places()
            self._padding = [
                _Padding.of(group, position, first, min(per_call, self.count - first), capacity)
                for first in range(0, self.count, per_call)
            ]
        return self._padding

    def _places(self) -> tuple[Tensor, Tensor]:
        """Each row's group (``count`` for rows in none) and its place in the group."""
        row = torch.arange(self.rows, device=self.ends.device)
        group = torch.searchsorted(self.ends, row, right=True)
        starts = torch.cat([_starts(self.ends), self.ends[-1:]])  # (rows in none: counted from the last end)
        return group, row - starts[group]


def _starts(ends: Tensor) -> Tensor:
    return torch.cat([ends.new_zeros(1), ends[:-1]])


@dataclass(frozen=True)
class Routing:
    """A MoE's assignments — each of ``n`` tokens to ``k`` distinct experts, ``top_idx [n, k]`` — as ``n x k`` rows
    grouped by expert, all on the device (sorts and searches: no host sync, no shape that depends on the routing).

    Each token's slots are first put in expert order (``slots``); entry ``t·k + j`` is token ``t``'s ``j``-th expert
    in that order, and row ``r`` of the grouped rows is entry ``order[r]`` (a stable sort: within an expert, tokens
    in order). ``combine`` adds each token's outputs slot after slot in expert order, as a loop over the experts in id
    order adds them, so the sum is the same on any device and whichever ranks computed which experts (an
    ``index_add`` of a token's k rows at once is not deterministic on CUDA). ``groups``: the rows of experts
    ``first .. first + count`` (those here), the others' (another rank's) last, in no group."""

    slots: Tensor  # [n, k]: top_idx[t, slots[t, j]] ascends in j
    order: Tensor  # [n·k]: the entry each row is
    inverse: Tensor  # [n·k]: the row each entry is
    keys: Tensor  # [n·k]: each row's expert less ``first`` (``count`` for the others'), ascending
    groups: Groups

    @classmethod
    def of(cls, top_idx: Tensor, first: int, count: int, others: bool) -> Routing:
        """``others``: whether ``top_idx`` may name experts outside ``first .. first + count`` (known without
        reading it)."""
        tokens, k = top_idx.shape
        chosen, slots = top_idx.sort(dim=1, stable=True)
        here = chosen.reshape(-1) - first
        if others:
            here = torch.where((here >= 0) & (here < count), here, count)
        keys, order = here.sort(stable=True)
        entries = torch.arange(tokens * k, device=top_idx.device)
        inverse = torch.empty_like(order).scatter_(0, order, entries)
        ends = torch.searchsorted(keys, torch.arange(count, device=top_idx.device), right=True)
        return cls(slots, order, inverse, keys, Groups(ends, tokens * k, tokens, partial=others))

    def rows(self, x: Tensor) -> Tensor:
        """Each row's token of ``x [n, H]``, ``[n·k, H]`` (indexed by ``[token, slot]`` entry, each once: the
        backward puts each row's gradient in its own place and sums a token's k of them, with no atomic adds)."""
        tokens, k = self.slots.shape
        return x[:, None].expand(tokens, k, x.shape[-1])[self.order // k, self.order % k]

    def combine(self, outputs: Tensor, weights: Tensor, dtype: torch.dtype) -> Tensor:
        """Each token's sum of its rows' ``outputs [n·k, H]`` weighted by the router (``weights [n, k]``, by the
        tokens' original slots) in ``dtype``, its slots added one after another in expert order."""
        tokens, k = self.slots.shape
        by_entry = outputs.index_select(0, self.inverse).view(tokens, k, -1)
        weighted = (by_entry * weights.gather(1, self.slots)[..., None]).to(dtype)
        out = torch.zeros(tokens, outputs.shape[-1], dtype=dtype, device=outputs.device)
        for slot in range(k):
            out = out + weighted[:, slot]
        return out


@dataclass(frozen=True)
class _Padding:
    """One ``bmm`` of the padded kernel: groups ``first .. first + count`` padded to ``capacity`` rows each;
    ``slot``: each row's place in the padded rows, ``count * capacity`` (a spare row) for rows of other groups."""

    first: int
    count: int
    capacity: int
    slot: Tensor

    @classmethod
    def of(cls, group: Tensor, position: Tensor, first: int, count: int, capacity: int) -> _Padding:
        local = group - first
        inside = (local >= 0) & (local < count)
        return cls(first, count, capacity, torch.where(inside, local * capacity + position, count * capacity))

    @property
    def spare(self) -> int:
        return self.count * self.capacity

    def pad(self, rows: Tensor) -> Tensor:
        """``rows [R, p]`` as ``[count, capacity, p]``, zeros where a group has fewer rows. (Every row of other
        groups is written to the spare row, which is dropped: whichever lands last, nothing reads it.)"""
        padded = rows.new_zeros(self.spare + 1, rows.shape[1])
        padded.index_put_((self.slot,), rows)
        return padded[: self.spare].view(self.count, self.capacity, -1)

    def unpad_into(self, out: Tensor, padded: Tensor) -> Tensor:
        """``out [R, q]`` with this call's rows taken from ``padded [count, capacity, q]``."""
        inside = self.slot < self.spare
        taken = padded.reshape(self.spare, -1).index_select(0, self.slot.clamp(max=self.spare - 1))
        return torch.where(inside[:, None], taken, out)


class GroupedKernel:
    """The two grouped products a grouped linear's forward and backward are made of."""

    def mm(self, a: Tensor, b: Tensor, groups: Groups) -> Tensor:
        """``a [R, p]`` by ``b [G, p, q]``: row ``r`` of group ``g`` times ``b[g]``, ``[R, q]`` (rows in no group:
        anything; ``Groups.masked`` zeroes them)."""
        raise NotImplementedError

    def mm_t(self, a: Tensor, c: Tensor, groups: Groups) -> Tensor:
        """``a [R, p]`` and ``c [R, q]``: for each group ``g``, its rows' ``a_g^T c_g``, ``[G, p, q]`` (zeros for a
        group without rows)."""
        raise NotImplementedError


class TorchGroupedMM(GroupedKernel):
    """torch's ``_grouped_mm`` (see the module's docstring for where it runs)."""

    def mm(self, a: Tensor, b: Tensor, groups: Groups) -> Tensor:
        return torch._grouped_mm(_aligned(a), b, offs=groups.offsets)

    def mm_t(self, a: Tensor, c: Tensor, groups: Groups) -> Tensor:
        return torch._grouped_mm(_aligned(a).t(), _aligned(c), offs=groups.offsets)

    @staticmethod
    def takes(rows: Tensor, weight: Tensor) -> bool:
        """Whether the kernel takes these operands (and runs without a host sync on their device)."""
        if rows.dtype != weight.dtype or not weight.is_contiguous() or not _torch_grouped_mm_on(rows.device):
            return False
        if any(width * rows.element_size() % ALIGNMENT for width in weight.shape[1:]):
            return False
        if rows.device.type == "cuda":
            hopper = torch.cuda.get_device_capability(rows.device)[0] == 9
            return hopper and rows.dtype == torch.bfloat16 and weight.data_ptr() % ALIGNMENT == 0
        return rows.dtype in (torch.float32, torch.bfloat16, torch.float16)


class PaddedBmm(GroupedKernel):
    """Each group's rows padded to a common capacity, one ``bmm`` over the stacked weights (``Groups.padding``)."""

    def mm(self, a: Tensor, b: Tensor, groups: Groups) -> Tensor:
        out = a.new_zeros(groups.rows, b.shape[-1])
        for part in groups.padding():
            product = torch.bmm(part.pad(a), b[part.first : part.first + part.count])
            out = part.unpad_into(out, product)
        return out

    def mm_t(self, a: Tensor, c: Tensor, groups: Groups) -> Tensor:
        parts = [torch.bmm(part.pad(a).transpose(1, 2), part.pad(c)) for part in groups.padding()]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class ShapesOnly(GroupedKernel):
    """The meta device's: the grouped kernel's outputs, without values."""

    def mm(self, a: Tensor, b: Tensor, groups: Groups) -> Tensor:
        return a.new_empty(groups.rows, b.shape[-1])

    def mm_t(self, a: Tensor, c: Tensor, groups: Groups) -> Tensor:
        return a.new_empty(groups.count, a.shape[1], c.shape[1])


def kernel_for(rows: Tensor, weight: Tensor) -> GroupedKernel:
    """The kernel for these operands (the module's docstring says which, and ``LONGSTRAW_GROUPED_MM``)."""
    if rows.device.type == "meta":
        return ShapesOnly()
    if kernel_choice() == "auto" and TorchGroupedMM.takes(rows, weight):
        return TorchGroupedMM()
    return PaddedBmm()


def kernel_choice() -> str:
    choice = os.environ.get(CHOICE_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{CHOICE_ENV}={choice!r}: choose one of {', '.join(CHOICES)}")
    return choice


def grouped_linear(rows: Tensor, weight: Tensor, groups: Groups, kernel: GroupedKernel | None = None) -> Tensor:
    """``F.linear(rows[r], weight[g])`` for each row ``r`` of group ``g`` (zeros for rows in none): ``rows [R, in]``
    sorted by group, ``weight [G, out, in]``. One autograd node; ``kernel``: ``kernel_for``'s unless given."""
    if rows.shape[0] != groups.rows or weight.shape[0] != groups.count:
        raise ValueError(
            f"grouped_linear: {rows.shape[0]} rows and {weight.shape[0]} weights for {groups.rows} rows in "
            f"{groups.count} groups"
        )
    out: Tensor = _GroupedLinear.apply(rows, weight, groups, kernel or kernel_for(rows, weight))
    return out


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: Tensor, weight: Tensor, groups: Groups, kernel: GroupedKernel) -> Tensor:
        ctx.save_for_backward(rows, weight)
        ctx.groups, ctx.kernel = groups, kernel
        if groups.rows == 0:
            return rows.new_zeros(0, weight.shape[1])
        return groups.masked(kernel.mm(rows, weight.transpose(1, 2), groups))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        rows, weight = ctx.saved_tensors
        groups: Groups = ctx.groups
        kernel: GroupedKernel = ctx.kernel
        grad_rows = grad_weight = None
        if groups.rows == 0:
            grad_rows, grad_weight = torch.zeros_like(rows), torch.zeros_like(weight)
        else:
            if ctx.needs_input_grad[0]:
                grad_rows = groups.masked(kernel.mm(grad, weight, groups))
            if ctx.needs_input_grad[1]:
                grad_weight = kernel.mm_t(grad, rows, groups)
        return grad_rows, grad_weight, None, None


def _aligned(t: Tensor) -> Tensor:
    """``t`` contiguous, its data where torch's grouped kernels take it (16-byte aligned on a GPU)."""
    t = t.contiguous()
    return t if t.device.type != "cuda" or t.data_ptr() % ALIGNMENT == 0 else t.clone()


@functools.cache
def _torch_grouped_mm_on(device: torch.device) -> bool:
    """Whether this torch has ``_grouped_mm`` for ``device``'s type (CPU: a tiny probe, since torch gained its CPU
    loop after its CUDA kernel)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type != "cpu":
        return device.type == "cuda"
    try:
        with _disable_current_modes():  # (real tensors even under a fake or tracking mode: the answer is cached)
            a, b = torch.ones(2, 4), torch.ones(1, 4, 4)
            torch._grouped_mm(a, b, offs=torch.tensor([2], dtype=torch.int32))
    except (RuntimeError, NotImplementedError):
        return False
    return True
