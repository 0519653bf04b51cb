"""Context parallelism (parallel/context.py) on 2 and 4 gloo processes: capture, extend, logits and GRPO gradients
in exact and detached mode equal one process (fp64, tiny models of every family), with shard boundaries inside a
GatedDeltaNet block and DSA's top-k drawing keys from several shards; each rank holds its share of the state.

The workers run once per mesh (``tests/support/context_parallel_worker.py`` writes each rank's results), against one
process's results computed once for both meshes; each test below checks one property of them, per family."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from context_parallel_worker import OVERRIDES, PROMPT, references, run

from longstraw_agents.parallel.context import _header, _parse

pytestmark = pytest.mark.distributed

MESHES = [pytest.param(2, id="cp2"), pytest.param(4, id="cp4")]
FAMILIES = sorted(OVERRIDES)
# results every rank computes the same way, compared with one process's (relative difference)
EQUAL_TO_ONE_PROCESS = (
    "logits",  # a sharded capture's logits
    "extend",  # a short extend after it (replicated, partials merged)
    "resumed",  # a capture over a parent whose rows sit on several ranks
    "exact",  # GRPO gradients, wavefront walk
    "detached",
    "kl_exact",  # with a KL term: the reference's state spread over the ranks too
    "short_exact",  # a prompt that leaves ranks without chunks
    "replicated_exact",  # EngineConfig.wavefront_walk=False
    "one_segment_exact",  # EngineConfig.layer_inputs_every=layers: every layer's input recomputed but the first's
    "shared_turn_exact",  # a loss-bearing fused root: its loss walked sharded
    "shared_turn_loss",  # ... and its loss metric summed over the ranks
    "turn_by_turn",  # a member's history grown by 30 short turns (replicated, spread over the ranks)
    "long_turn",  # a long turn over a parent every rank holds some of (sharded)
    "agent_exact",  # an agent-shaped group: long leaves captured sharded
    "agent_detached",
    "agent_replicated_detached",  # ... shorter than the shared prompt: replicated
    "agent_threshold_exact",  # ... sharded anyway (EngineConfig.sharded_extend_tokens)
    "edge_one_token",  # a sharded extend of one token walked back: one rank computes, the others hold context rows
    "edge_fewer_than_ranks",  # ... of 3 tokens
    "edge_long",  # ... of 30
    "edge_detached_shared",  # ... giving the context no gradient while a replay's sits in it (the same StateGrad)
)
# computed at cp 2 only (the suite's time): cp 4 runs the capture, extend, exact and detached steps, the short
# prompt, the agent-shaped group walked back sharded and the edge cases
CP2_ONLY = {
    "kl_exact", "replicated_exact", "one_segment_exact", "shared_turn_exact", "shared_turn_loss",
    "agent_replicated_detached", "agent_threshold_exact",
}  # fmt: skip


def _computed(mesh_results: dict[str, Any], what: str) -> bool:
    return mesh_results["world"] == 2 or what not in CP2_ONLY


@pytest.fixture(scope="module")
def one_process() -> dict[str, dict[str, Any]]:
    """One process's results, per family: what every rank of every mesh compares with."""
    return {family: references(family) for family in FAMILIES}


@pytest.fixture(scope="module", params=MESHES)
def mesh_results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, one_process: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    world = request.param
    out = tmp_path_factory.mktemp(f"cp{world}")
    args = (world, str(out / "store"), str(out), one_process)
    mp.start_processes(run, args=args, nprocs=world, start_method="fork")
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(world)]
    return {"world": world, "ranks": ranks}


def test_messages_of_many_tensors_arrive_whole(mesh_results: dict[str, Any]) -> None:
    assert all(r["many_tensors"] == 0.0 for r in mesh_results["ranks"])  # broadcast and point to point of 40 tensors
    assert all(r["many_tensors_staged"] == 0.0 for r in mesh_results["ranks"])  # ... staged through host memory


def test_a_message_header_says_which_tensors_travel_on_the_device() -> None:
    """The receiver allocates a device tensor on its device and a host tensor on the host (a runs header, or a
    message staged through host memory); the header carries each tensor's dtype, shape and side."""
    tensors = [torch.zeros(3, 2, dtype=torch.int64), torch.empty(4, 5, 6, dtype=torch.bfloat16, device="meta")]
    assert _parse(_header(tensors)) == [(torch.int64, False, (3, 2)), (torch.bfloat16, True, (4, 5, 6))]


@pytest.mark.parametrize("what", EQUAL_TO_ONE_PROCESS)
@pytest.mark.parametrize("family", FAMILIES)
def test_results_equal_one_process(mesh_results: dict[str, Any], family: str, what: str) -> None:
    if not _computed(mesh_results, what):
        assert all(f"{family}/{what}" not in result for result in mesh_results["ranks"])
        return
    for rank, result in enumerate(mesh_results["ranks"]):
        assert result[f"{family}/{what}"] <= 1e-10, (rank, result[f"{family}/{what}"])


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_captures_only_its_own_chunks_once(mesh_results: dict[str, Any], family: str) -> None:
    ranks = mesh_results["ranks"]
    for result in ranks:
        assert result[f"{family}/layer_runs"] == result[f"{family}/layers"] * result[f"{family}/own_chunks"]
    assert sum(r[f"{family}/own_chunks"] for r in ranks) == ranks[0][f"{family}/chunks"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_wavefront_walk_runs_fewer_layers_than_one_process(mesh_results: dict[str, Any], family: str) -> None:
    """A rank's layer evaluations in an exact step (its chunks, the shared branches) fall below one process's
    (every chunk twice); the replicated walk (every rank recomputing every chunk) runs more."""
    for result in mesh_results["ranks"]:
        assert result[f"{family}/exact_layer_positions"] < result[f"{family}/exact_single_layer_positions"]
        if _computed(mesh_results, "replicated_exact"):
            assert result[f"{family}/replicated_exact_layer_positions"] > result[f"{family}/exact_layer_positions"]


@pytest.mark.parametrize("family", FAMILIES)
def test_long_leaves_are_walked_sharded(mesh_results: dict[str, Any], family: str) -> None:
    """Exact mode: an agent-shaped group's long leaves are captured and walked back sharded (a rank evaluates its
    chunks of them), so a rank runs fewer layer evaluations than one process — a replicated walk back (every chunk
    again on every rank) runs more. (Detached mode replays each answer from the turn's state: no long leaves.)"""
    for result in mesh_results["ranks"]:
        assert result[f"{family}/agent_exact_sharded_walks_back"] == 2  # each member's history
        assert result[f"{family}/agent_exact_layer_positions"] < result[f"{family}/agent_exact_single_layer_positions"]
        assert all(result[f"{family}/edge_{case}_sharded"] for case in ("one_token", "fewer_than_ranks", "long"))


@pytest.mark.parametrize("family", FAMILIES)
def test_kept_layer_inputs_are_what_the_planner_counts(mesh_results: dict[str, Any], family: str) -> None:
    """Hybrids keep a recurrent state per layer beside the hidden vectors: a few KiB over the plan."""
    for result in mesh_results["ranks"]:
        planned, kept = result[f"{family}/planned_layer_inputs"], result[f"{family}/layer_inputs"]
        assert planned <= kept <= planned * 1.05 + 65536, (planned, kept)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_position_is_stored_once_by_its_owner(mesh_results: dict[str, Any], family: str) -> None:
    ranks, world = mesh_results["ranks"], mesh_results["world"]
    held = [r[f"{family}/growing_bytes"] for r in ranks]
    total, chunk = ranks[0][f"{family}/single_growing_bytes"], ranks[0][f"{family}/chunk_bytes"]
    assert sum(held) == total
    assert max(held) <= total / world + chunk  # a capture is cut evenly (+- a chunk)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_members_own_history_spreads_over_the_ranks(mesh_results: dict[str, Any], family: str) -> None:
    """30 turns of 7 tokens after the 61-token prompt: each rank holds a quarter/half of the path, within one turn
    (each turn's piece goes to the rank holding the least), and every position once."""
    ranks, world = mesh_results["ranks"], mesh_results["world"]
    positions = [r[f"{family}/turn_by_turn_positions"] for r in ranks]
    assert sum(positions) == PROMPT + 30 * 7
    assert max(positions) - min(positions) <= 7, positions
    assert max(positions) <= 1.1 * sum(positions) / world, positions
    held = [r[f"{family}/turn_by_turn_bytes"] for r in ranks]
    assert sum(held) == ranks[0][f"{family}/turn_by_turn_single_bytes"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_kl_references_state_is_spread_like_the_policys(mesh_results: dict[str, Any], family: str) -> None:
    if not _computed(mesh_results, "kl_exact"):
        return
    ranks, world = mesh_results["ranks"], mesh_results["world"]
    held = [r[f"{family}/reference_bytes"] for r in ranks]
    total, chunk = ranks[0][f"{family}/single_reference_bytes"], ranks[0][f"{family}/chunk_bytes"]
    assert sum(held) == total and max(held) <= total / world + chunk
