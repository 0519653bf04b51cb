"""Peak-memory structure: the tracker on a hand-computed graph, and the trainer's modes flat in group size.

Parameter gradients are materialised before each tracked call (``p.grad = zeros_like(p)``) so that gradient
accumulation is in place and the tracker sees only what a mode itself keeps alive.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from longstraw_agents.memory import MemoryTracker, host_placement, tensor_bytes
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.trainer import grpo_backward

N = 1000  # float32 elements: 4000 bytes per tensor


# --- the tracker ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tracker_follows_a_hand_computed_graph(device: str):
    x = torch.ones(N, device=device).requires_grad_()  # made before the tracker: never counted
    with MemoryTracker() as mem:
        y = x * 2  # 4000
        assert mem.current_bytes == 4000
        z = y.exp()  # 4000, saved by exp's backward
        loss = z.sum()  # 4
        assert mem.current_bytes == mem.peak_bytes == 8004
        view = y.view(10, 100)  # a view shares y's storage: counted once
        y.add_(1)  # in place: no new storage
        assert mem.current_bytes == 8004
        del y, view  # nothing saved y (exp saves its output): released
        assert mem.current_bytes == 4004
        loss.backward()
        # backward's peak: z + loss + d loss (4) + d z (4000, a 4-byte expand is a view) + d x (4000)
        assert mem.peak_bytes == 4000 + 4 + 4 + 4000 + 4000
        del z, loss  # the graph is gone; x.grad (made inside the tracker) is all that lives on
        assert mem.current_bytes == 4000 == x.grad.untyped_storage().nbytes()
    assert mem.peak_bytes == 12008


def test_tracker_baseline_and_reset_peak():
    with MemoryTracker(baseline=100) as mem:
        assert mem.current_bytes == mem.peak_bytes == 100
        a = torch.zeros(N)
        del a
        assert mem.current_bytes == 100 and mem.peak_bytes == 4100
        mem.reset_peak()
        assert mem.peak_bytes == 100
        b = torch.zeros(N // 2)
        assert mem.peak_bytes == 2100
        del b


def test_tracker_sees_tensors_kept_alive_by_autograd_until_the_graph_dies():
    w = torch.ones(N, requires_grad=True)
    with MemoryTracker() as mem:
        out = (w * w).sin().sum()  # w*w is saved by sin's backward though no Python name holds it
        assert mem.peak_bytes == 4000 + 4000 + 4  # w*w, sin(w*w), the sum
        assert mem.current_bytes == 4000 + 4  # sin saves its input, not its output: sin(w*w) is gone already
        del out
        assert mem.current_bytes == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tracker_ignores_views_and_in_place_updates_of_pre_existing_tensors(device: str):
    w = torch.ones(N, N, device=device)  # 4 MB made before the tracker, like a parameter
    buf = torch.empty(N, N, device=device)  # like a pre-allocated .grad
    with MemoryTracker() as mem:
        views = [w.t(), w.view(-1), w[:10], w.detach(), torch.ops.aten.alias(w), w.as_strided((10,), (1,))]
        w.add_(1)
        torch.mul(w, 2, out=buf)
        torch.empty(0, device=device).set_(w)  # a fresh 0-byte tensor moved onto w's storage
        assert mem.peak_bytes == 0
        copy = w.t().contiguous()  # a fresh storage: counted
        assert mem.current_bytes == 4 * N * N
        del copy, views
    assert mem.current_bytes == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tracker_follows_an_out_buffer_it_allocated_as_it_grows(device: str):
    a = torch.ones(N, device=device)
    with MemoryTracker() as mem:
        out = torch.empty(0, device=device)  # counted at 0 bytes
        torch.mul(a, 2, out=out)  # resized in place to 4000 bytes
        assert mem.current_bytes == mem.peak_bytes == 4000
        out.add_(1)
        view = out.view(10, 100)
        assert mem.current_bytes == 4000
        del out, view
        assert mem.current_bytes == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tracker_counts_what_linear_allocates_not_its_pre_existing_weight(device: str):
    x = torch.ones(4, N, device=device)
    w1 = torch.ones(500, N, device=device, requires_grad=True)  # 2 MB
    b1 = torch.zeros(500, device=device, requires_grad=True)
    w2 = torch.ones(10, 500, device=device, requires_grad=True)
    with MemoryTracker() as mem:
        with torch.no_grad():
            y = F.linear(x, w1, b1)  # addmm(b1, x, w1.t()): the transpose views w1, only y (4 x 500) is new
        assert mem.peak_bytes == mem.current_bytes == 8000
        del y
        mem.reset_peak()
        r = F.linear(x, w1, b1).relu()  # the linear output (8000) dies once relu (8000, saved) has run
        out = F.linear(r, w2)  # 160; saves r and w2, and w2 costs nothing
        del r
        assert mem.peak_bytes == 8000 + 8000
        assert mem.current_bytes == 8000 + 160  # the saved activation and the output
        del out
        assert mem.current_bytes == 0


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_backward_into_materialised_grads_counts_no_grad_buffers(device: str):
    x = torch.ones(4, N, device=device)
    w1, b1, w2 = (torch.ones(*s, device=device, requires_grad=True) for s in ((500, N), (500,), (10, 500)))
    params = [w1, b1, w2]

    def step() -> MemoryTracker:
        with MemoryTracker() as mem:
            F.linear(F.linear(x, w1, b1).relu(), w2).sum().backward()
        return mem

    fresh = step()  # .grad is None: backward allocates the gradients and they live on
    assert fresh.current_bytes == tensor_bytes(p.grad for p in params) == tensor_bytes(params)
    grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    accumulated = step()
    assert all(p.grad is g for p, g in zip(params, grads, strict=True))  # accumulated in place
    assert accumulated.current_bytes == 0
    # the peak holds the activations and one weight gradient before it is added in place, never a .grad buffer
    assert fresh.peak_bytes >= tensor_bytes(params)
    assert accumulated.peak_bytes < tensor_bytes([w1]) + 16000


def test_host_placed_storages_count_on_the_host_for_their_whole_life():
    """What offloading code allocates inside ``host_placement`` is the host's: never in the device's counts or its
    roles, however it is used later (an in-place update outside the block, a view), and freed from the host's."""
    kept: list[torch.Tensor] = []
    with MemoryTracker(roles={"moments": lambda: kept}) as mem:
        device = torch.zeros(1000)  # 4,000 device bytes
        with host_placement():
            kept.append(torch.zeros(500))  # 2,000 host bytes
            grown = torch.ones(250)  # 1,000 more
        kept[0].add_(1)  # in place, outside the block: still the host's
        assert (mem.current_bytes, mem.host_bytes) == (4000, 3000)
        assert mem.snapshot() == {"moments": 0, "other": 4000}
        del grown
        assert mem.host_bytes == 2000
        more = device * 2  # the device's again
    assert (mem.peak_bytes, mem.host_peak_bytes) == (8000, 3000)
    assert more.shape == device.shape


def test_tensor_bytes_counts_each_storage_once():
    a = torch.zeros(N)
    b = torch.zeros(10, dtype=torch.float64)
    assert tensor_bytes([a, a[:10], a.view(10, 100), b]) == 4000 + 80
    assert tensor_bytes([]) == 0


# --- the trainer's modes -----------------------------------------------------------------------------------------
@functools.cache
def model(family: str) -> nn.Module:
    net = tiny_model(family)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    return net


def peak_bytes(family: str, mode: str, group_size: int, prompt_len: int, chunk: int, completion_len: int = 6) -> int:
    gen = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, 256, (prompt_len,), generator=gen)
    completions = [torch.randint(0, 256, (completion_len,), generator=gen) for _ in range(group_size)]
    rewards = [float(k % 3) for k in range(group_size)]
    stats = grpo_backward(model(family), prompt, completions, rewards, mode=mode, chunk_size=chunk, track_memory=True)
    return stats.peak_bytes


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_tree_modes_peak_is_flat_in_group_size(family: str, mode: str):
    small, large = (peak_bytes(family, mode, g, prompt_len=60, chunk=8) for g in (2, 8))
    assert large <= 1.05 * small, f"{mode}: G=2 {small} B, G=8 {large} B"


def test_naive_peak_grows_with_group_size():
    """Naive is the reference the other modes are measured against: one full graph per member over the whole
    sequence, all alive together as in a batched forward (DESIGN.md: memory grows with context x G)."""
    small, large = (peak_bytes("llama", "naive", g, prompt_len=60, chunk=8) for g in (2, 8))
    assert large >= 2.5 * small, f"naive: G=2 {small} B, G=8 {large} B"


def test_exact_peak_on_a_long_prompt_stays_well_below_naive():
    exact = peak_bytes("llama", "exact", 4, prompt_len=400, chunk=16)
    naive = peak_bytes("llama", "naive", 4, prompt_len=400, chunk=16)
    detached = peak_bytes("llama", "detached", 4, prompt_len=400, chunk=16)
    assert exact < 0.25 * naive, f"exact {exact} B vs naive {naive} B"
    assert detached <= exact  # exact holds the state's gradient and one recomputed chunk on top


# --- what is not an op: storage lifetimes, resizes, FSDP2's gathers; roles --------------------------------------
def test_a_storage_taken_from_its_tensor_is_released_when_it_dies():
    with MemoryTracker() as mem:
        p = torch.nn.Parameter(torch.zeros(N))  # 4000, tracked
        p.data = torch.zeros(N // 2)  # the first storage dies though p lives on: 2000 remain
        assert mem.current_bytes == 2000 and mem.peak_bytes == 6000
        del p
        assert mem.current_bytes == 0


def test_storage_resizes_are_allocations():
    with MemoryTracker() as mem:
        x = torch.zeros(N)
        x.untyped_storage().resize_(0)  # as FSDP2 frees a gathered parameter
        assert mem.current_bytes == 0
        x.untyped_storage().resize_(2 * 4 * N)
        assert mem.current_bytes == mem.peak_bytes == 8000
        del x
    assert torch.UntypedStorage.resize_ is torch._C.StorageBase.resize_  # the tracker's hook is gone


def test_a_storage_grown_from_nothing_counts_though_made_before():
    x = torch.zeros(N)
    x.untyped_storage().resize_(0)  # as FSDP2 frees a gathered parameter before the tracker opens
    with MemoryTracker() as mem:
        x.untyped_storage().resize_(4 * N)  # and gathers into it again
        assert mem.current_bytes == 4000
        x.untyped_storage().resize_(0)
        assert mem.current_bytes == 0
        x.untyped_storage().resize_(4 * N)
        del x
        assert mem.current_bytes == 0


def test_roles_at_the_peak_and_the_most_each_held():
    kept: list[torch.Tensor] = []
    w = torch.ones(N)  # made before: the baseline, under its role
    with MemoryTracker(baseline=4000, roles={"weights": lambda: [w], "kept": lambda: kept}) as mem:
        kept.append(torch.zeros(N))  # 4000 kept
        scratch = torch.zeros(2 * N)  # 8000 of no role: the peak (16000)
        del scratch
        kept.append(torch.zeros(2 * N))  # kept grows to 12000, below the peak (4000 + 12000 = 16000, not above)
        mem.snapshot()  # below the peak the roles are looked at on request
        assert mem.peak_roles == {"weights": 4000, "kept": 4000, "other": 8000}
        assert mem.role_peaks == {"weights": 4000, "kept": 12000, "other": 8000}
        mem.reset_peak()
        assert mem.peak_roles == {"weights": 4000, "kept": 12000, "other": 0}


def test_fsdp2_gathers_count_while_whole_and_shards_by_their_local_bytes(tmp_path):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        with MemoryTracker() as mem:
            layer = nn.Linear(100, 100, bias=False)  # 40,000 bytes, freed once sharded
            fully_shard(layer, mesh=init_device_mesh("cpu", (1,)))
            assert isinstance(layer.weight, DTensor)
            sharded = mem.current_bytes
            assert 40_000 <= sharded < 40_100  # the shard (one rank: all of it) and a few bytes of FSDP2 scalars
            layer.unshard()
            assert mem.current_bytes - sharded >= 40_000  # the whole weight (and the gather's buffer)
            layer.reshard()
            assert mem.current_bytes == sharded  # resized to nothing: freed
            doubled = layer.weight * 2  # a DTensor op: counted by its local tensor
            assert mem.current_bytes == sharded + 40_000
            del doubled
    finally:
        dist.destroy_process_group()
