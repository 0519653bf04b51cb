"""``parallel.fsdp_state``: the one module that reads FSDP2's private state. Each reader on a model FSDP2 shards over
one gloo process, and no other module of the package reaching into FSDP2's internals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import init_device_mesh

import longstraw_agents
import longstraw_agents.trainer
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel import fsdp_state
from longstraw_agents.parallel.fsdp import compute_dtype, offloaded, shard_model

# FSDP2's private names this package reads (torch 2.13), and its private package
PRIVATE = re.compile(
    r"_get_fsdp_state|_fsdp_param_group|_mp_policy|_sharded_param_data|_unsharded_param|_all_gather_result|"
    r"_lazy_init|\bfsdp_params\b|fsdp\._fully_shard"
)


def test_no_module_but_fsdp_state_reads_fsdp2_internals() -> None:
    roots = [Path(longstraw_agents.__file__).parent, Path(longstraw_agents.trainer.__file__).parent]  # (trainer/)
    readers = sorted(
        str(path)
        for root in roots
        for path in root.rglob("*.py")
        if path.name != "fsdp_state.py" and PRIVATE.search(path.read_text())
    )
    assert readers == []


@pytest.fixture
def one_process(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.distributed
def test_each_reader_on_a_sharded_model(one_process) -> None:
    model = tiny_model("llama", dtype=torch.float64, layers=2)
    shard_model(model, one_process, compute_dtype=torch.float32, offload=True)
    assert fsdp_state.mixed_precision_policy(model).param_dtype == compute_dtype(model) == torch.float32
    assert isinstance(fsdp_state.offload_policy(model), CPUOffloadPolicy) and offloaded(model)
    fsdp_state.lazy_init(model)  # (what the first gather does: the units' dtypes are set then)
    layer = model.model.layers[0]
    params = fsdp_state.unit_params(layer)
    assert len(params) == len(list(layer.parameters()))
    packed = fsdp_state.packed_shard(params)  # one rank: every parameter whole, cast to the compute dtype
    assert packed.dtype == torch.float32 and packed.numel() == sum(p.numel() for p in layer.parameters())
    groups = fsdp_state.param_groups(model)
    assert len(groups) == 3  # the root and its two layers
    assert fsdp_state.whole_now(groups) == ([], [])
    layer.unshard()
    weights, gradients = fsdp_state.whole_now(groups)
    assert [w.dtype for w in weights] == [torch.float32] * len(params) and gradients == []
    layer.reshard()
    assert fsdp_state.whole_now(groups) == ([], [])
