"""``parallel.fsdp`` on gloo CPU processes: sampling from a policy FSDP2 shards (``OneRankGather``) — the sampling
rank holds one decoder layer whole at a time while its shard peers join each gather, and samples exactly what one
process holding the whole model samples — and ``LayerGather`` leaving a block by an exception."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from layer_gather_worker import run as fail_in_a_block
from sampling_worker import CHUNK, run, sample

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models.presets import tiny_model

pytestmark = pytest.mark.distributed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize(
    ("family", "dp", "cp", "hsdp"),
    [("llama", 1, 2, False), ("qwen3_5", 1, 2, False), ("glm_moe_dsa", 2, 2, True)],
    ids=["llama-dp1xcp2", "qwen3_5-dp1xcp2", "glm_moe_dsa-dp2xcp2-hsdp"],
)
def test_a_rank_samples_a_sharded_policy_a_layer_at_a_time(tmp_path, family, dp, cp, hsdp) -> None:
    spec = {"family": family, "dp": dp, "cp": cp, "hsdp": hsdp}
    world = dp * cp
    mp.start_processes(run, args=(world, _free_port(), str(tmp_path), spec), nprocs=world, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    model = tiny_model(family, dtype=torch.float64, seed=0)
    expected = sample(Engine(model, EngineConfig(chunk_size=CHUNK)), model.config.vocab_size)
    assert all("must be rank 0 of its shard group" in r["refused"] for r in ranks)
    samplers = [r for r in ranks if r["samples"]]
    assert len(samplers) == dp  # the first cp rank of each dp rank (HSDP: each replica's shard group its own)
    for result in samplers:
        assert result["most_gathered"] == 1  # a decoder layer at a time (and the root unit)
        for (ids, logprobs), (want_ids, want_logprobs) in zip(result["generations"], expected, strict=True):
            assert ids == want_ids
            assert logprobs == pytest.approx(want_logprobs, abs=1e-10)
    served = [r["gathers"] for r in ranks if not r["samples"]]  # its peers joined every one of its gathers
    assert served == [samplers[0]["gathers"]] * (world - dp) and served[0] >= model.config.num_hidden_layers


def test_a_block_left_by_an_exception_drops_its_gradient_without_a_collective(tmp_path) -> None:
    """A failing rank must not enter a reduction its peers are not in: the layer is freed and its gradient dropped;
    the next block, ending normally, reduces as before."""
    spec = {"dp": 1, "cp": 2}
    mp.start_processes(fail_in_a_block, args=(2, _free_port(), str(tmp_path), spec), nprocs=2, start_method="fork")
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["reductions"] == ["reduce"], rank  # the second block's only
        assert not any(result["whole_grads"]) and not any(result["shard_grads"]), rank
        assert result["gathered_now"] == [], rank
