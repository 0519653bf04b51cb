"""``parallel.parallelize``: placement in one step. One process (no process group) and FSDP2 over one gloo process
(a dp 1 x cp 1 mesh: ``fully_shard`` runs as on any mesh, its units and policies the same). The steps on real meshes
equal one process's in tests/trainer/test_data_parallel.py, whose workers place through here."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel import ParallelMesh, Placement, parallelize
from longstraw_agents.parallel.fsdp import LayerGather, offloaded
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer


def _policy_and_reference(dtype: torch.dtype = torch.float64) -> tuple[torch.nn.Module, torch.nn.Module]:
    policy = tiny_model("llama", dtype=dtype, seed=0, layers=2)
    return policy, copy.deepcopy(policy).train()


def test_one_process_without_mixed_precision_is_the_identity_up_to_the_reference_freezing() -> None:
    policy, reference = _policy_and_reference()
    parameters = list(policy.parameters())
    placement = parallelize(policy, reference, device="cpu")
    assert placement.master is placement.computed is policy and placement.compute_copy is None
    assert placement.compute_dtype is None and placement.sharding.weights is None and placement.mesh is None
    assert list(policy.parameters()) == parameters and all(p.requires_grad for p in parameters)
    assert placement.reference is reference and not reference.training
    assert not any(p.requires_grad for p in reference.parameters())


def test_an_unsharded_policy_computes_with_a_copy_and_its_reference_keeps_the_master_dtype() -> None:
    policy, reference = _policy_and_reference()
    placement = parallelize(Engine(policy, EngineConfig(chunk_size=4)), reference, compute_dtype=torch.float32)
    assert placement.master is policy and placement.compute_dtype == torch.float32
    assert {p.dtype for p in placement.computed.parameters()} == {torch.float32}
    assert {p.dtype for p in policy.parameters()} == {p.dtype for p in reference.parameters()} == {torch.float64}
    trainer = GRPOTrainer(placement, GRPOConfig(chunk_size=4, beta=0.1, mixed_precision={"compute_dtype": "float32"}))
    assert trainer.engine.model is placement.computed and trainer.ref_engine.model is reference
    assert trainer.engine.config.chunk_size == trainer.ref_engine.config.chunk_size == 4


def test_what_cannot_be_placed_is_refused_naming_the_fix() -> None:
    policy, reference = _policy_and_reference()
    with pytest.raises(ValueError, match=r"copy\.deepcopy"):
        parallelize(policy, policy)
    with pytest.raises(ValueError, match="need fsdp=True and a mesh"):
        parallelize(policy, offload=True)
    placement = parallelize(policy, reference, device="cpu")
    with pytest.raises(ValueError, match="the Placement holds the KL reference"):
        GRPOTrainer(placement, GRPOConfig(beta=0.1), ref_model=reference)
    with pytest.raises(ValueError, match=r"computes? in its own dtype .* asks for torch.bfloat16"):
        GRPOTrainer(placement, GRPOConfig(bf16=True))


@pytest.fixture
def one_process_mesh(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield ParallelMesh.build(dp=1, cp=1)
    dist.destroy_process_group()


@pytest.mark.distributed
def test_fsdp2_shards_the_policy_and_its_reference_as_one(one_process_mesh: ParallelMesh) -> None:
    """Each decoder layer a unit and the model the root; mixed precision from FSDP2's policy (no compute copy); the
    reference sharded the same way, its shards cast to the compute dtype (frozen: no masters needed) while its
    buffers keep theirs, as the policy's do; both reached a decoder layer at a time."""
    policy, reference = _policy_and_reference()
    buffers = {name: b.dtype for name, b in policy.named_buffers()}
    mesh = one_process_mesh
    placement = parallelize(policy, reference, mesh=mesh, fsdp=True, compute_dtype=torch.float32)
    assert placement.compute_copy is None and placement.computed is policy
    assert placement.compute_dtype == torch.float32 and not offloaded(policy)
    for model in (policy, reference):
        units = [model, *model.model.layers]
        assert all(isinstance(unit, FSDPModule) for unit in units)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        assert {name: b.dtype for name, b in model.named_buffers()} == buffers
    assert {p.dtype for p in policy.parameters()} == {torch.float64}
    assert {p.dtype for p in reference.parameters()} == {torch.float32}
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    assert isinstance(placement.sharding.weights, LayerGather)
    assert placement.reference_sharding is not None and isinstance(placement.reference_sharding.weights, LayerGather)
    trainer = GRPOTrainer(placement, GRPOConfig(beta=0.1, mixed_precision={"compute_dtype": "float32"}))
    assert trainer.model is policy and trainer.engine.weights is placement.sharding.weights
    assert trainer.ref_engine is not None and trainer.ref_engine.weights is placement.reference_sharding.weights
    with pytest.raises(ValueError, match=r"already sharded .* parallelize\(\.\.\., fsdp=True\)"):
        parallelize(policy, mesh=mesh, fsdp=True)
    with pytest.raises(ValueError, match="placed to compute in torch.float32 but GRPOConfig.mixed_precision asks"):
        GRPOTrainer(placement, GRPOConfig())


@pytest.mark.distributed
def test_mixed_precision_with_context_parallelism_needs_fsdp2(one_process_mesh: ParallelMesh) -> None:
    policy, _ = _policy_and_reference()
    engine = Engine(policy, EngineConfig(chunk_size=4), shards=one_process_mesh.context_parallel())
    with pytest.raises(ValueError, match=r"needs the model sharded \(parallelize\(\.\.\., fsdp=True\)"):
        parallelize(engine, mesh=one_process_mesh, compute_dtype=torch.float32)
    assert isinstance(parallelize(engine, mesh=one_process_mesh), Placement)
