"""``parallel.fsdp`` on gloo CPU processes: sampling on the mesh from a policy FSDP2 shards (``parallel.sampling``:
the cp ranks sample together, a decoder layer gathered at a time) samples exactly what one process holding the whole
model samples — and ``LayerGather`` leaving a block by an exception."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp
from layer_gather_worker import run as fail_in_a_block
from sampling_worker import CHUNK, LAYERS, NEW_TOKENS, run, sample

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
def test_the_cp_ranks_sample_a_sharded_policy_together_a_layer_at_a_time(tmp_path, family, dp, cp, hsdp) -> None:
    """Rollouts on the mesh: the leader's generations equal one process's (a batched turn, a long observation
    computed sharded, an eviction resumed from a mark, a token-by-token turn); every member's path is spread over
    the cp ranks, each position stored once; a rank holds a decoder layer whole at a time (and the gathers started
    ahead for a sharded capture's wavefront: ``prefetch_window``); the batched decoder
    over a cp-sharded engine equals stepping each member alone on one process."""
    spec = {"family": family, "dp": dp, "cp": cp, "hsdp": hsdp}
    world = dp * cp
    mp.start_processes(run, args=(world, _free_port(), str(tmp_path), spec), nprocs=world, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    model = tiny_model(family, dtype=torch.float64, seed=0, layers=LAYERS)
    expected = sample(Engine(model, EngineConfig(chunk_size=CHUNK)), model.config.vocab_size)
    leaders = [r for r in ranks if r["leads"]]
    assert len(leaders) == dp  # the first cp rank of each dp rank
    for result in leaders:
        for (ids, logprobs), (want_ids, want_logprobs) in zip(result["generations"], expected, strict=True):
            assert ids == want_ids
            assert logprobs == pytest.approx(want_logprobs, abs=1e-10)
    assert all(r["calls"] == 8 for r in ranks if not r["leads"])  # fork, 2 turns, 3 appends, an edit, a turn
    for group in range(dp):  # (ranks of one dp rank are consecutive: cp is the inner dimension)
        members = ranks[group * cp : (group + 1) * cp]
        for k, length in enumerate(members[0]["lengths"]):
            held = [r["held"][k] for r in members]
            assert sum(held) == length, held  # every position stored once
            assert max(held) - min(held) <= NEW_TOKENS + 1, held  # within a turn of even
    # a layer at a time: a balanced capture holds cp on every rank (the cell's and those started ahead, each
    # layer gathered once per wave of runs; gathered once, rank 0 held 2cp - 1), decoding one at a time
    assert all(r["most_gathered"] == cp for r in ranks), [r["most_gathered"] for r in ranks]
    assert all(r["failures"] == ["ValueError", "LeaderFailed"] for r in ranks if not r["leads"])
    assert all(r["decoder_gap"] <= 1e-10 for r in ranks), [r["decoder_gap"] for r in ranks]


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
