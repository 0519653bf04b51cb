"""A ``MemoryTracker`` whose meta-device ops are answered from a cache of their outputs' layouts: the planner's.

The planner (``plan.probes``) runs the real engine and trainer on the meta device, where a tensor has a shape and a
size but no storage. Torch computes most meta results in Python (``torch._refs`` and ``torch._prims``: broadcasting,
type promotion, stride propagation), some 0.1–0.3 ms an op; a plan runs hundreds of thousands of them, most with the
same inputs again and again (every block of a delta-rule scan, every layer of a period, every chunk). On the meta
device an op's result can depend on nothing but its inputs' layouts, its other arguments and the default dtype, so an
op that returns fresh tensors has its first answer's layouts kept (``MetaLayouts``), and the next call with the same
ones gets new meta tensors of those layouts (``torch.empty_strided``, which C++ answers at once): the same shapes,
strides, dtypes and storage sizes, which ``CachedMemoryTracker`` counts as its ``MemoryTracker`` counts an op's
outputs — one Python dispatch per op, not two.

What torch computes every time (and the tracker counts as ever):
- views, in-place and ``out=`` ops (any argument or return with an alias annotation in the op's schema), and an op
  whose first answer shared a storage with an input or another output (``_unsafe_view`` does without saying so);
- ops with side effects or without tensor results: outside ``aten``/``prims`` (collectives), seeded random ops, an
  op returning nothing or a scalar;
- anything not entirely plain meta tensors (a CPU tensor, a DTensor or other subclass, a symbolic size), and an
  output that ``empty_strided`` would not make alike (an offset into its storage, a storage larger than it spans).
"""

from __future__ import annotations

from typing import Any

import torch

from longstraw_agents.memory import MemoryTracker

Layout = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]  # (shape, stride, dtype) of a fresh output
_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tensor types whose ops this cache may answer (no subclass dispatch)
_NAMESPACES = ("aten", "prims")  # ops without side effects beside their outputs (collectives live elsewhere)
_TENSOR_RETURNS = ("Tensor", "Tensor[]", "Tensor?")


class _Uncacheable(Exception):
    """An argument whose value cannot key the cache (not hashable, or not a plain meta tensor)."""


def _key(value: Any) -> Any:
    """``value`` as part of a cache key: a meta tensor by its layout, containers element by element, the rest by
    type and value (``1``, ``1.0`` and ``True`` differ). (Called for every argument of every op: kept plain.)"""
    kind = type(value)
    if kind in _PLAIN:
        if not value.is_meta or value.layout is not torch.strided:
            raise _Uncacheable
        return (value.shape, value.stride(), value.dtype, value.storage_offset())
    if kind is tuple or kind is list:
        return (kind, *[_key(v) for v in value])
    if kind is int or kind is float or kind is bool:
        return (kind, value)
    if kind is dict:  # (the keyword arguments)
        return (dict, *((name, _key(value[name])) for name in sorted(value)))
    if isinstance(value, torch.Tensor | list | tuple | dict):  # a tensor subclass, a container's subclass
        raise _Uncacheable
    try:
        hash(value)  # a SymInt is not hashable: no key
    except TypeError as err:
        raise _Uncacheable from err
    return (kind, value)


def answers_fresh(func: torch._ops.OpOverload) -> bool:
    """Whether ``func`` may be answered from the cache: an ``aten``/``prims`` op without randomness that writes none
    of its arguments and returns only new tensors (its schema declares no alias)."""
    schema = func._schema
    if func.namespace not in _NAMESPACES or torch.Tag.nondeterministic_seeded in func.tags:
        return False
    if not schema.returns or any(str(ret.type) not in _TENSOR_RETURNS for ret in schema.returns):
        return False
    if any(arg.alias_info is not None for arg in schema.arguments):
        return False
    return all(ret.alias_info is None for ret in schema.returns)


def _made_alike(tensor: torch.Tensor) -> bool:
    """Whether ``torch.empty_strided`` of ``tensor``'s layout makes a tensor like it, storage size included (what a
    plan counts): a plain strided meta tensor at offset 0 whose storage spans exactly its elements."""
    if type(tensor) not in _PLAIN or tensor.device.type != "meta" or tensor.layout != torch.strided:
        return False
    if tensor.storage_offset() != 0 or tensor.is_conj() or tensor.is_neg():
        return False
    span = 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True))
    nbytes = span * tensor.element_size() if tensor.numel() else 0
    return tensor.untyped_storage().nbytes() == nbytes


def _outputs(out: Any) -> list[Any]:
    return list(out) if isinstance(out, tuple | list) else [out]


def _layouts(out: Any) -> tuple[Layout | None, ...] | None:
    """The layouts of ``out``'s tensors (None for a None output), or None where one cannot be remade alike."""
    layouts: list[Layout | None] = []
    for item in _outputs(out):
        if item is None:
            layouts.append(None)
        elif isinstance(item, torch.Tensor) and _made_alike(item):
            layouts.append((tuple(item.shape), item.stride(), item.dtype))
        else:
            return None
    return tuple(layouts)


def _storages(value: Any) -> set[int]:
    if isinstance(value, torch.Tensor):
        return {value.untyped_storage()._cdata}
    if isinstance(value, list | tuple):
        return set().union(*(_storages(v) for v in value))
    if isinstance(value, dict):
        return _storages(list(value.values()))
    return set()


def _aliases(out: Any, inputs: Any) -> bool:
    """Whether an output shares storage with an input or with another output: what the op did, not only what its
    schema declares."""
    keys = [t.untyped_storage()._cdata for t in _outputs(out) if isinstance(t, torch.Tensor)]
    return len(set(keys)) < len(keys) or bool(set(keys) & _storages(inputs))


class MetaLayouts:
    """The layouts of meta ops' first answers, by op, input layouts and arguments: what ``CachedMemoryTracker``
    answers from (one for any number of trackers and plans; emptied when it holds ``limit`` answers). ``hits`` and
    ``misses`` count the ops answered and those torch computed that could have been."""

    def __init__(self, limit: int = 1_000_000) -> None:
        self.limit = limit
        self._known: dict[Any, tuple[type | None, tuple[Layout | None, ...]]] = {}
        # by the op's id: an OpOverload lives as long as torch (and its Python __hash__ cost more than the lookup)
        self._answerable: dict[int, bool] = {}
        self.hits = self.misses = 0

    def key(self, func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any | None:
        """What identifies this call of ``func`` to the cache, or None where it must be computed."""
        op = id(func)
        answerable = self._answerable.get(op)
        if answerable is None:
            answerable = self._answerable[op] = answers_fresh(func)
        if not answerable:
            return None
        try:  # (a factory op without a dtype makes the default one)
            return (op, torch.get_default_dtype(), _key(args), _key(kwargs))
        except _Uncacheable:
            return None

    def remade(self, key: Any) -> Any | None:
        """New meta tensors laid out as the first answer to ``key``'s call, or None before there was one."""
        known = self._known.get(key)
        if known is None:
            return None
        self.hits += 1
        return _remade(*known)

    def remember(self, key: Any, out: Any, inputs: Any) -> None:
        """Keep the layouts of ``out``, torch's answer to ``key``'s call on ``inputs``, where they may be remade."""
        self.misses += 1
        if _aliases(out, inputs):
            self._answerable[key[0]] = False  # an alias its schema does not declare: never answered for the op
            return
        layouts = _layouts(out)
        if layouts is None:
            return
        if len(self._known) >= self.limit:
            self._known.clear()
        self._known[key] = (type(out) if isinstance(out, tuple | list) else None, layouts)


class CachedMemoryTracker(MemoryTracker):
    """A ``MemoryTracker`` that answers meta ops from ``layouts`` where it may (see the module's docstring), counting
    the tensors it makes as the fresh storages torch's own answer would have been; every other op as its base."""

    def __init__(self, layouts: MetaLayouts, **tracker: Any) -> None:
        super().__init__(**tracker)
        self.layouts = layouts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = None if types else self.layouts.key(func, args, kwargs)  # (types: a tensor subclass dispatches)
        if key is None:
            return super().__torch_dispatch__(func, types, args, kwargs)
        out = self.layouts.remade(key)
        if out is not None:
            self.count_fresh(out)
            return out
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.layouts.remember(key, out, (args, kwargs))
        return out


def _empty(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


def _remade(container: type | None, layouts: tuple[Layout | None, ...]) -> Any:
    """New meta tensors of ``layouts``, in ``container`` (a tuple, a list, a ``torch.return_types`` result) or alone."""
    made = [None if lay is None else _empty(*lay) for lay in layouts]
    return made[0] if container is None else container(made)
