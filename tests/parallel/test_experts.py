"""Expert parallelism's pieces that need no process group: the model's routed experts summed over parts of the
experts (what each rank computes), the engine's and the mesh's refusals. The distributed step is tested against one
process in tests/trainer/test_data_parallel.py and tests/app/test_distributed.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.mla import MoE
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.parallel.experts import check_experts_divide, expert_units


def test_the_routed_experts_are_the_sum_of_each_ranks_experts() -> None:
    """Each rank computes the experts it holds (``MoE.experts_of`` over its slice of the stacked weights) on every
    token; the shares add up to the routed experts of one process, and a token that chose none of a rank's experts
    gets zeros from it."""
    model = tiny_model("glm_moe_dsa", dtype=torch.float64, seed=0)
    moe = next(layer.mlp for layer in Engine(model).adapter.layers if isinstance(layer.mlp, MoE))
    x = torch.randn(7, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    top_idx, weights = moe.route(x)
    gate_up, down = moe.experts.gate_up_proj, moe.experts.down_proj
    per_rank = moe.num_experts // 4
    held = [slice(r * per_rank, (r + 1) * per_rank) for r in range(4)]  # rank r's experts
    shares = [moe.experts_of(x, top_idx, weights, gate_up[k], down[k], k.start) for k in held]
    whole = moe.local(x, top_idx, weights)
    assert torch.allclose(sum(shares), whole, rtol=1e-12, atol=1e-14)
    for r, share in enumerate(shares):
        chose_none = ~((top_idx >= r * per_rank) & (top_idx < (r + 1) * per_rank)).any(dim=1)
        assert torch.equal(share[chose_none], torch.zeros_like(share[chose_none]))


def test_experts_must_divide_over_the_ranks_and_exist() -> None:
    model = tiny_model("glm_moe_dsa", dtype=torch.float64, seed=0)
    assert len(expert_units(model)) == model.config.num_hidden_layers - 1  # (a dense first layer)
    check_experts_divide(model, 4)
    with pytest.raises(ValueError, match="a multiple of 3 routed experts per layer, the model has 8"):
        check_experts_divide(model, 3)
    with pytest.raises(ValueError, match="needs a mixture of experts"):
        check_experts_divide(tiny_model("llama", dtype=torch.float64, seed=0), 2)


class _BindingWeights:
    """Weights whose sharding takes over the experts and needs every rank's layer calls alike, with no rounds for a
    sharded extend's (``LayerGather(experts=...)`` has them: ``ExpertExchange``)."""

    lockstep = True
    rounds = None

    def __init__(self) -> None:
        self.bound = False

    def bind(self, layers: object) -> None:
        self.bound = True


def test_an_engine_refuses_sharded_extends_where_the_sharding_has_no_rounds() -> None:
    """Each MoE call is a collective of the cp ranks: an extend computed sharded (each rank its own tokens, at its
    own time) needs its calls made as rounds, so without them the engine refuses a config that would shard one —
    before the weights take over any layer."""
    model = tiny_model("glm_moe_dsa", dtype=torch.float64, seed=0)
    shards = SimpleNamespace(transport=None)
    refused = _BindingWeights()
    with pytest.raises(ValueError, match=r"EngineConfig\(sharded_extends=False\)"):
        Engine(model, EngineConfig(), shards=shards, weights=refused)  # type: ignore[arg-type]
    assert not refused.bound
    taken = _BindingWeights()
    Engine(model, EngineConfig(sharded_extends=False), shards=shards, weights=taken)  # type: ignore[arg-type]
    assert taken.bound
