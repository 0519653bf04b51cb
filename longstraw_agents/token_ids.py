"""The one check of token ids: a 1-D sequence of integers, from a tensor, a numpy array or a Python sequence.

Floats and bools are refused, never cast: ``[3.9, 4.0]`` is not ``[3, 4]`` and ``[True, False]`` is not ``[1, 0]``.
The engine (which also checks the vocabulary range) and the trainer (which names the argument in its errors) both
call ``as_token_ids``. Only torch and numpy are imported here, so any layer may use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

TokenIds = Tensor | np.ndarray | Sequence[int]


def as_token_ids(
    values: TokenIds, name: str | None = None, *, allow_empty: bool = False, vocab_size: int | None = None
) -> Tensor:
    """``values`` as a 1-D ``torch.long`` tensor (on the input tensor's device; CPU for arrays and sequences).

    name: the argument's name, prefixed to every error (``"prompt_ids: token ids must be integers, ..."``).
    allow_empty: accept zero ids (otherwise a ``ValueError``).
    vocab_size: when given, every id must lie in ``[0, vocab_size)``.
    Raises ``TypeError`` for anything that is not integers and ``ValueError`` for a wrong shape, emptiness or range.
    """
    where = f"{name}: " if name else ""
    ids = _as_tensor(values, where)
    if ids.dim() != 1:
        raise ValueError(f"{name or 'token ids'}: expected a 1-D sequence, got shape {tuple(ids.shape)}")
    if ids.numel() == 0 and not allow_empty:
        raise ValueError(f"{name or 'token ids'} {'is' if name else 'are'} empty: pass at least one token")
    ids = ids.to(torch.long)
    if vocab_size is not None and ids.numel() and ids.device.type != "meta":  # meta (the planner) has no values
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{where}token ids must be in [0, {vocab_size}); got values in [{lo}, {hi}]")
    return ids


def _as_tensor(values: TokenIds, where: str) -> Tensor:
    """An integer tensor of ``values``' own shape; the dtype is checked before the shape (a string is a type error).

    An empty array or sequence has no values to be non-integer (``np.asarray([])`` is float64); a tensor carries
    its dtype explicitly and is checked even when empty."""
    if isinstance(values, Tensor):
        if values.dtype == torch.bool or values.dtype.is_floating_point or values.dtype.is_complex:
            raise TypeError(f"{where}token ids must be integers, got dtype {str(values.dtype).removeprefix('torch.')}")
        return values.detach()
    try:
        array = values if isinstance(values, np.ndarray) else np.asarray(list(values))
    except (TypeError, ValueError) as err:  # not iterable, or ragged nesting
        raise TypeError(f"{where}token ids must be a 1-D integer tensor or a sequence of ints: {err}") from None
    if array.size and array.dtype.kind not in "iu":
        raise TypeError(f"{where}token ids must be integers, got dtype {array.dtype}")
    return torch.from_numpy(np.ascontiguousarray(array.astype(np.int64)))
