"""The planner's meta-op cache (``meta_cache``): an answered op's outputs are laid out as torch's own and counted as
its own, what must be computed is, and a plan is the same to the byte with the cache and without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import longstraw_agents.plan.probes as probes
from longstraw_agents.engine import EngineConfig
from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models.lora import LoraSpec
from longstraw_agents.plan import Plan, PlanRequest, plan_memory
from longstraw_agents.plan.meta_cache import CachedMemoryTracker, MetaLayouts, answers_fresh

aten = torch.ops.aten


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(*shape, device="meta", dtype=dtype)


def layout(t: torch.Tensor) -> tuple:
    return (t.shape, t.stride(), t.dtype, t.storage_offset(), t.untyped_storage().nbytes(), t.device)


# ops whose output layouts torch computes in Python: broadcasting, promotion, a permuted input's strides kept
OPS = [
    lambda: meta(3, 4, 5).permute(2, 0, 1) + meta(5, 1, 1, dtype=torch.float64),
    lambda: meta(2, 8, 4) @ meta(2, 4, 3),
    lambda: meta(6, 7).t().sum(dim=0, keepdim=True),
    lambda: torch.max(meta(4, 9), dim=1),  # a torch.return_types result
    lambda: meta(4, 9, dtype=torch.bfloat16).float().exp(),
    lambda: torch.cat([meta(2, 3), meta(4, 3)]),
    lambda: meta(8, 8).expand(2, 8, 8) * 2.0,
]


@pytest.mark.parametrize("op", OPS)
def test_an_answered_op_lays_out_its_outputs_as_torch_does(op) -> None:
    expected = op()
    layouts = MetaLayouts()
    with CachedMemoryTracker(layouts):
        first, again = op(), op()
    assert layouts.hits > 0
    for out in (first, again):
        assert type(out) is type(expected)
        got, want = (out, expected) if isinstance(out, torch.Tensor) else (list(out), list(expected))
        assert [layout(t) for t in (got if isinstance(got, list) else [got])] == [
            layout(t) for t in (want if isinstance(want, list) else [want])
        ]


def test_views_in_place_and_out_ops_pass_through() -> None:
    x, y, out = meta(4, 6), meta(4, 6), meta(4, 6)
    layouts = MetaLayouts()
    with CachedMemoryTracker(layouts):
        for _ in range(2):
            view = x.view(6, 4)
            assert view.untyped_storage()._cdata == x.untyped_storage()._cdata
            assert x.add_(y) is x
            assert torch.mul(x, y, out=out) is out
            assert x.detach().untyped_storage()._cdata == x.untyped_storage()._cdata
    assert layouts.hits == 0
    assert not any(answers_fresh(op) for op in (aten.view.default, aten.add_.Tensor, aten.mul.out, aten.detach.default))
    assert answers_fresh(aten.mul.Tensor) and answers_fresh(aten.bmm.default)


def test_an_op_that_aliases_without_declaring_it_is_never_answered() -> None:
    x = meta(2, 3, 4)
    layouts = MetaLayouts()
    with CachedMemoryTracker(layouts) as tracker:
        for _ in range(3):
            flat = aten._unsafe_view(x, [6, 4])  # declares a fresh tensor, returns a view of x's storage
            assert flat.untyped_storage()._cdata == x.untyped_storage()._cdata
    assert layouts.hits == 0 and tracker.peak_bytes == 0


def test_side_effects_randomness_and_other_devices_pass_through() -> None:
    cpu = torch.ones(3)
    layouts = MetaLayouts()
    with CachedMemoryTracker(layouts):
        for _ in range(2):
            assert torch.equal(cpu + 1, torch.full((3,), 2.0))  # computed, not remade on the meta device
            torch.rand(3, device="meta")
    assert layouts.hits == 0
    assert not answers_fresh(aten.rand.default) and not answers_fresh(aten._assert_async.msg)


def test_the_cached_tracker_counts_what_the_tracker_counts() -> None:
    def peaks(tracker: MemoryTracker) -> tuple[int, int]:
        with tracker:
            a, b = meta(64, 32), meta(32, 16)
            for _ in range(3):
                c = (a @ b).relu() + 1
                d = c.t().contiguous()
                kept = c[1:].clone()
                del c
            del d
            now = tracker.current_bytes
        del kept
        return tracker.peak_bytes, now

    layouts = MetaLayouts()
    assert peaks(CachedMemoryTracker(layouts)) == peaks(MemoryTracker())
    assert layouts.hits > 0


def test_the_cache_is_bounded() -> None:
    layouts = MetaLayouts(limit=2)
    with CachedMemoryTracker(layouts):
        for n in range(1, 6):
            meta(n) + 1
    assert len(layouts._known) <= 2


def plans(request: PlanRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[Plan, Plan]:
    """``request`` planned with the planner's cache (which answered ops) and without it."""
    with monkeypatch.context() as patched:
        layouts = MetaLayouts()
        patched.setattr(probes, "PROBE_LAYOUTS", layouts)
        cached = plan_memory(request)
        answered = layouts.hits
        assert answered > 0
        patched.setattr(probes, "CACHE_META_OPS", False)
        computed = plan_memory(request)
        assert layouts.hits == answered  # (torch computed every op)
    return cached, computed


ENGINE = EngineConfig(chunk_size=64)
LORA = LoraSpec(r=4, alpha=8, target_modules="all-linear")
EXPERTS = ENGINE.updated(sharded_extends=False)  # (expert parallelism replicates every extend: the run's default)


@pytest.mark.parametrize(
    "request_args",
    [
        {"model": "tiny-llama", "mode": "exact", "gpus": 2, "lora": LORA},
        {"model": "tiny-qwen3_5", "mode": "detached", "gpus": 4, "dp": 2, "hsdp": True, "dtype": torch.bfloat16},
        {"model": "tiny-qwen3_5", "mode": "exact", "gpus": 2, "history": 2048, "turns": 4},
        {"model": "tiny-glm_moe_dsa", "mode": "exact", "gpus": 2, "expert_parallel": True, "engine": EXPERTS},
    ],
    ids=["dense-exact-cp2-lora", "hybrid-detached-dp2-hsdp", "hybrid-exact-agent", "moe-exact-ep"],
)
def test_a_plan_is_the_same_to_the_byte_with_the_cache_and_without(request_args, monkeypatch) -> None:
    request = PlanRequest(**({"context": 512, "group": 2, "completion": 16, "engine": ENGINE} | request_args))
    cached, computed = plans(request, monkeypatch)
    assert dataclasses.asdict(cached) == dataclasses.asdict(computed)
    assert cached.table() == computed.table()
