"""Batched decoding (engine/decoding.py, models/batch.py): one forward for a batch of members equals each member stepped
alone with ``Engine.step`` — logits, and the states it leaves behind — for every family, with groups sharing a
prefix, a member in no group, members dropping out mid-batch and tool turns between generations."""

from __future__ import annotations

import pytest
import torch
from decoding_cases import GROUPS, PROMPTS, VOCAB, decode_both_ways

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.engine.decoding import Decoder, Member, decode_step
from longstraw_agents.models.presets import tiny_model

FAMILIES = ["llama", "qwen3", "qwen3_5", "glm_moe_dsa"]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decoding_matches_stepping_each_member_in_fp32(family):
    engine = Engine(tiny_model(family), chunk_size=8)
    assert decode_both_ways(engine, PROMPTS, GROUPS) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decoding_matches_stepping_each_member_in_fp64(family):
    engine = Engine(tiny_model(family, dtype=torch.float64), chunk_size=8)
    assert decode_both_ways(engine, PROMPTS, GROUPS) < 1e-12


@pytest.mark.parametrize("attention", ["eager", "cpu-flash"])
def test_each_attention_backend_reads_the_shared_prefix(attention):
    engine = Engine(tiny_model("qwen3", dtype=torch.float64), EngineConfig(chunk_size=8, attention=attention))
    assert decode_both_ways(engine, PROMPTS, GROUPS) < 1e-12


def test_dsa_members_that_see_every_key_take_the_dense_path():
    """While every member's context fits DSA's index_topk, the selection is skipped (dense attention), as in the
    engine's forward; past it, the sparse path must agree as well (covered by the prompts above)."""
    engine = Engine(tiny_model("glm_moe_dsa", dtype=torch.float64, index_topk=64), chunk_size=8)
    assert decode_both_ways(engine, PROMPTS, GROUPS) < 1e-12


def test_a_groups_prefix_is_read_once_per_step_for_all_its_members(monkeypatch):
    """The shared prefix is attended with the group's queries stacked as rows of one kernel call."""
    import longstraw_agents.models.batch as batch

    calls: list[int] = []
    original = batch.partial_attention

    def counted(q, blocks, attention, scale):
        calls.append(q.shape[0])
        return original(q, blocks, attention, scale)

    monkeypatch.setattr(batch, "partial_attention", counted)
    engine = Engine(tiny_model("llama", layers=2))
    fork = engine.capture(list(range(30)))
    other = engine.capture(list(range(5)))
    members = [Member(fork, fork)] * 4 + [Member(other, other)] * 2
    decode_step(engine, members, [1, 2, 3, 4, 5, 6])
    assert calls == [4, 2, 4, 2]  # per layer: one call per group, its members' queries as rows


def test_positions_go_in_place_or_into_fresh_storage_as_engine_step_does():
    engine = Engine(tiny_model("llama"))
    fork = engine.capture(list(range(12)))
    states, _ = decode_step(engine, [Member(fork, fork), Member(fork, fork)], [1, 2], reserve=5)
    again, _ = decode_step(engine, [Member(states[0], fork)], [3], reserve=5)
    assert [s.num_tokens for s in (*states, again[0])] == [13, 13, 14]
    arenas = [s.blocks(0)[-1].arena for s in (*states, again[0])]
    assert arenas[0] is not arenas[1] and arenas[2] is arenas[0]  # one fresh arena each, then appends in place
    assert arenas[1].capacity == 1 + 5
    assert fork.num_tokens == 12  # the shared prefix is untouched


def test_a_leaving_members_state_holds_its_session_as_one_chunk_in_its_own_storage():
    engine = Engine(tiny_model("qwen3_5"))
    fork = engine.capture(list(range(9)))
    decoder = Decoder(engine, [Member(fork, fork)] * 3)
    for token in (1, 2, 3):
        decoder.step([token] * len(decoder.live))
    [state] = decoder.leave([1])
    assert decoder.live == [0, 2] and state.num_tokens == 12 and state.chunks[-1].length == 3
    layer = next(i for i, layer in enumerate(engine.adapter.layers) if not layer.mixer.grows)
    kept = state.recurrent(layer).tensors[1]
    assert kept.untyped_storage().nbytes() == kept.numel() * kept.element_size()  # not a view of the batch's
    [untouched] = Decoder(engine, [Member(fork, fork)]).leave([0])
    assert untouched is fork  # given no token, a member leaves with its own state
    with pytest.raises(ValueError, match="left"):
        empty = Decoder(engine, [Member(fork, fork)])
        empty.leave([0])
        empty.step([])


def test_bad_members_are_refused():
    engine = Engine(tiny_model("llama"))
    other = Engine(tiny_model("llama", seed=1))
    fork = engine.capture([1, 2, 3])
    unrelated = engine.capture([4, 5, 6, 7])
    with pytest.raises(ValueError, match="at least one member"):
        decode_step(engine, [], [])
    with pytest.raises(ValueError, match="but 2 tokens"):
        decode_step(engine, [Member(fork, fork)], [1, 2])
    with pytest.raises(ValueError, match="not made by this engine"):
        decode_step(engine, [Member(other.capture([1]))], [1])
    with pytest.raises(ValueError, match="not an ancestor"):
        decode_step(engine, [Member(fork, unrelated)], [1])
    with pytest.raises(ValueError, match="empty"):
        decode_step(engine, [Member(engine.empty_state())], [1])
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        decode_step(engine, [Member(fork, fork)], [VOCAB])
