"""``parallel.roles``: the roles a MemoryTracker attributes a rank's bytes to, on a model FSDP2 shards over one gloo
process (its gathers then copy, and free by resizing, as on any mesh)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import init_device_mesh

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.memory import MemoryTracker, tensor_bytes
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel.fsdp import shard_model
from longstraw_agents.parallel.fsdp_state import param_groups, whole_now
from longstraw_agents.parallel.roles import step_roles

pytestmark = pytest.mark.distributed


@pytest.fixture
def one_process(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_roles_follow_gathers_gradients_optimizer_and_states(one_process) -> None:
    model = tiny_model("llama", dtype=torch.float32)
    shard_model(model, one_process)
    optimizer = torch.optim.AdamW(model.parameters())
    shards = tensor_bytes(model.parameters())
    layer = model.model.layers[0]
    groups = param_groups(model)
    with step_roles(model, optimizer) as roles:
        with MemoryTracker(baseline=shards, roles=roles) as tracker:
            assert whole_now(groups) == ([], [])
            layer.unshard()
            weights, _ = whole_now(groups)
            assert [tuple(w.shape) for w in weights] == [tuple(p.shape) for p in layer.parameters()]  # whole
            layer.reshard()
            assert whole_now(groups) == ([], [])
            units = [m for m in model.modules() if isinstance(m, FSDPModule)]
            for unit in units:
                unit.unshard()
            state = Engine(model, EngineConfig(chunk_size=4)).capture(torch.arange(8))
            held = tensor_bytes(state.tensors())
            tracker.snapshot()
            assert tracker.role_peaks["captured state"] == held > 0
            assert tracker.peak_roles["weights"] == shards
            for unit in units:
                unit.reshard()
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            optimizer.step()
            tracker.snapshot()
            assert tracker.role_peaks["gradients"] == shards  # one rank: a shard is the whole parameter
            assert tracker.role_peaks["optimizer state"] == 2 * shards  # AdamW's two moments
            del state
    assert roles["captured state"]() == []  # no state alive
