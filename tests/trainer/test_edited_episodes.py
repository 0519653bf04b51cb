"""GRPO over episodes that edit their context: each episode is one sample (one reward, one advantage, one
aggregation weight over all its loss tokens), each assistant token is scored once under the physical sequence it was
generated in, and the tree over the physical sequences gives the per-sequence reference's loss and gradient.

The reference (``tests/support/grpo_reference.py``) takes the hand-written physical sequences of
``tests/support/edited_episodes.py``, one full forward each, and aggregates per episode; it shares no code with the
trajectory's replay of edits, the segmenter or the trainer.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from edited_episodes import BLOCKS, REWARDS, SCRIPTS, VOCAB, block_tokens, expected_sequences, play, script_log
from grpo_reference import engine_logits, grpo_loss, parameter_grads, relative_l2, sequence_logprobs
from reference_dsa import reference_logits as dsa_reference_logits
from torch import nn

from longstraw_agents.engine import Engine
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.segmenter import Member, episode_members
from longstraw_agents.trainer import LossConfig, grpo_backward_trajectories
from longstraw_agents.trainer.group import batch_weighted, make_group, trajectory_group
from longstraw_agents.trajectory import Segment, Trajectory

CHUNK = 8
MODES = ["naive", "detached", "exact"]
FAMILIES = ["llama", "qwen3_5", "glm_moe_dsa"]
OFF_POLICY = {0, 2, 5}  # episodes with behaviour log-probs (the others on-policy)


@functools.cache
def model(family: str) -> nn.Module:
    return tiny_model(family, dtype=torch.float64, seed=0)


def reference_logits_fn(family: str, net: nn.Module):
    """A full forward sharing no code with the trainer's walks, exact in fp64 (transformers' own casts its norms
    and rotary angles to fp32): the engine's one-graph forward from an empty state, or the DSA definition."""
    if family == "glm_moe_dsa":
        return lambda ids: dsa_reference_logits(net, ids)
    return engine_logits(Engine(net))


def rows(logits_fn, tokens):
    """Per episode and hand-written physical sequence: (ids, mask over targets, current log-probs of targets)."""
    out = []
    for script, sequences in zip(SCRIPTS, expected_sequences(), strict=True):
        log = script_log(script)
        for seq in sequences:
            ids = torch.as_tensor(seq.tokens(log, tokens), dtype=torch.long)
            out.append((ids, torch.as_tensor(seq.loss_mask(log, tokens)[1:]), sequence_logprobs(logits_fn, ids)))
    return out


def edited_group(logits_fn, tokens) -> tuple[list[Trajectory], list[torch.Tensor | None]]:
    """The episodes with behaviour log-probs (current ones shifted at random) on the assistant segments of
    ``OFF_POLICY`` episodes, and the same log-probs as the reference's rows (aligned with targets; None on-policy)."""
    gen = np.random.default_rng(3)
    with torch.no_grad():
        current = rows(logits_fn, tokens)
    trajectories, olds = [], []
    row = 0
    for k, (script, sequences) in enumerate(zip(SCRIPTS, expected_sequences(), strict=True)):
        log = script_log(script)
        behaviour: dict[int, np.ndarray] = {}
        for seq in sequences:
            logp = np.concatenate([[np.nan], current[row][2].numpy()])  # aligned with ids
            old = np.full(len(logp), np.nan)
            for index in seq.generated:
                where = seq.span(index, log, tokens)
                shifted = logp[where] - gen.uniform(-0.5, 0.5, where.stop - where.start)
                behaviour[index] = shifted.astype(np.float32)  # what a segment stores
                old[where] = behaviour[index]
            olds.append(torch.as_tensor(old[1:]) if k in OFF_POLICY else None)
            row += 1
        logprobs = behaviour.get if k in OFF_POLICY else (lambda index: None)
        trajectories.append(play(script, tokens, logprobs))
    return trajectories, olds


def reference(net, logits_fn, tokens, olds, loss: dict):
    net.zero_grad(set_to_none=True)
    members = rows(logits_fn, tokens)
    episodes = [k for k, sequences in enumerate(expected_sequences()) for _ in sequences]
    result = grpo_loss(
        [lp for _, _, lp in members], [m for _, m, _ in members], REWARDS, old_logps=olds, episodes=episodes, **loss
    )
    result.loss.backward()
    return float(result.loss.detach()), parameter_grads(net)


def trained(net, trajectories, mode: str, loss: dict):
    net.zero_grad(set_to_none=True)
    stats = grpo_backward_trajectories(
        net, trajectories, REWARDS, mode=mode, config=LossConfig(**loss), chunk_size=CHUNK
    )
    return stats, parameter_grads(net)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_tree_over_physical_sequences_equals_the_per_sequence_reference(family: str):
    net = model(family)
    logits_fn = reference_logits_fn(family, net)
    tokens = block_tokens()
    trajectories, olds = edited_group(logits_fn, tokens)
    loss = {"epsilon": 0.2, "epsilon_high": 0.28}
    expected_loss, expected = reference(net, logits_fn, tokens, olds, loss)
    runs = {mode: trained(net, trajectories, mode, loss) for mode in MODES}

    assert relative_l2(runs["exact"][1], expected) <= 1e-9
    assert relative_l2(runs["naive"][1], expected) <= 1e-9
    assert relative_l2(runs["detached"][1], expected) > 1e-2  # the prefix's gradient is dropped there
    for stats, _ in runs.values():
        assert stats.loss == pytest.approx(expected_loss, rel=1e-12)


@pytest.mark.parametrize("aggregation", ["seq-mean", "dr-grpo"])
def test_an_episode_is_one_sample_whichever_sequences_its_tokens_are_in(aggregation: str):
    """seq-mean and dr-grpo count episodes (G = 6, not the 11 physical sequences) and seq-mean divides an episode's
    loss by its tokens over all its sequences."""
    net = model("llama")
    logits_fn = reference_logits_fn("llama", net)
    tokens = block_tokens(seed=1)
    trajectories, olds = edited_group(logits_fn, tokens)
    loss = {"aggregation": aggregation, "max_completion_length": 64}
    expected_loss, expected = reference(net, logits_fn, tokens, olds, loss)
    stats, grads = trained(net, trajectories, "exact", loss)
    assert stats.loss == pytest.approx(expected_loss, rel=1e-12)
    assert relative_l2(grads, expected) <= 1e-9
    assert stats.num_members == len(REWARDS) and len(stats.advantages) == len(REWARDS)

    per_sequence_group = trajectory_group(trajectories, REWARDS, LossConfig(**loss))
    weights = {e: t.weight for t, e in zip(per_sequence_group.terms, per_sequence_group.episodes, strict=True)}
    if aggregation == "seq-mean":  # 1 / (G n_episode), n over all the episode's sequences
        assert weights[0] == pytest.approx(1 / (6 * (5 + 6 + 5 + 4)))
    else:
        assert all(w == pytest.approx(1 / (6 * 64)) for w in weights.values())


def test_shared_prefixes_are_evaluated_once_across_sequences_and_episodes():
    """The sharing figure: the tree's positions against the summed lengths of the physical sequences."""
    net = model("llama")
    trajectories = [play(script, block_tokens()) for script in SCRIPTS]
    stats, _ = trained(net, trajectories, "exact", {})
    lengths = [
        len(seq.tokens(script_log(script), block_tokens()))
        for script, sequences in zip(SCRIPTS, expected_sequences(), strict=True)
        for seq in sequences
    ]
    assert stats.sequences == len(lengths) == 11
    assert stats.sequence_tokens == sum(lengths)
    # system + task + a1 are in all eleven; every edit's own tokens once
    assert stats.unique_tokens < 0.5 * sum(lengths)
    assert stats.forward_tokens < stats.sequence_tokens - len(lengths)  # naive evaluates every target of every one


@pytest.mark.parametrize("family", FAMILIES)
def test_a_sequence_after_an_edit_extends_the_kept_prefix_to_a_fresh_capture(family: str):
    """Engine logits of the sequence after an eviction, extended from the state of the prefix it keeps (the system
    prompt, the task, the first answer), equal a fresh capture of the whole sequence, positions from 0."""
    net = model(family)
    engine = Engine(net, chunk_size=CHUNK)
    tokens = block_tokens()
    log = script_log(SCRIPTS[0])
    before, after = (torch.as_tensor(seq.tokens(log, tokens)) for seq in expected_sequences()[0])
    kept = len(tokens["system"]) + len(tokens["task"]) + len(tokens["a1"])
    assert torch.equal(before[:kept], after[:kept]) and not torch.equal(before[: kept + 1], after[: kept + 1])
    with torch.no_grad():
        prefix = engine.capture(after[:kept])
        engine.extend(prefix, before[kept:])  # the sequence before the edit, from the same state
        extended = engine.logits(prefix, after[kept:])
        fresh = engine.logits(engine.empty_state(), after)[kept:]
        reference = reference_logits_fn(family, net)(after)[kept:]
    assert torch.allclose(extended, fresh, rtol=0, atol=1e-10)
    assert torch.allclose(extended, reference, rtol=0, atol=1e-9)


def test_the_tree_holds_every_distinct_prefix_of_the_sequences_once():
    """Its positions are the distinct (non-empty) prefixes of the hand-written sequences: shared ones count once."""
    net = model("llama")
    tokens = block_tokens()
    trajectories = [play(script, tokens) for script in SCRIPTS]
    stats, _ = trained(net, trajectories, "exact", {})
    rows = [
        tuple(seq.tokens(script_log(script), tokens).tolist())
        for script, sequences in zip(SCRIPTS, expected_sequences(), strict=True)
        for seq in sequences
    ]
    assert stats.unique_tokens == len({row[: k + 1] for row in rows for k in range(len(row))})


def growing_group(size: int) -> list[Trajectory]:
    """``size`` episodes that share two turns, evict the first tool output, then each go on with its own turns."""
    tokens = block_tokens(seed=4)
    rng = np.random.default_rng(5)
    shared = [Segment(BLOCKS[b][0], tokens[b]) for b in ("system", "task", "a1", "tool1", "a2", "tool2")]
    group = []
    for _ in range(size):
        episode = Trajectory(list(shared))
        episode.evict([3], Segment("tool", tokens["evicted"]))
        for role, length in (("assistant", 6), ("tool", 30), ("assistant", 5)):
            episode.append(Segment(role, rng.integers(0, VOCAB, length)))
        group.append(episode)
    return group


def test_exact_mode_memory_stays_flat_in_the_group_size_with_edits():
    """Peak tracked bytes of an exact backward over 2 and 8 edited episodes: the state and one branch at a time,
    whatever G (naive's per-member graphs grow with it)."""
    net = model("llama")
    peaks = {}
    for mode in ("exact", "naive"):
        for size in (2, 8):
            rewards = [float(k % 3) for k in range(size)]
            net.zero_grad(set_to_none=True)
            stats = grpo_backward_trajectories(
                net, growing_group(size), rewards, mode=mode, chunk_size=CHUNK, track_memory=True
            )
            peaks[mode, size] = stats.peak_bytes
    assert peaks["exact", 8] <= 1.1 * peaks["exact", 2]
    assert peaks["naive", 8] > 2 * peaks["naive", 2]


def test_batch_normalisation_pools_episodes_not_sequences():
    """seq-mean over two groups as one batch: every episode weighs 1 / (G_batch n_episode), n over all its
    sequences, G_batch the episodes of both groups."""
    trajectories = [play(script, block_tokens()) for script in SCRIPTS]
    config = LossConfig(aggregation="seq-mean", normalization="batch")
    groups = [
        trajectory_group(trajectories[:3], REWARDS[:3], config),
        trajectory_group(trajectories[3:], REWARDS[3:], config),
    ]
    pooled = batch_weighted(groups, config)
    for group, episodes in zip(pooled, (trajectories[:3], trajectories[3:]), strict=True):
        for term, episode in zip(group.terms, group.episodes, strict=True):
            loss_tokens = int(episodes[episode].loss_mask()[1:].sum())  # each generated token once, in the log
            assert term.weight == pytest.approx(1 / (len(REWARDS) * loss_tokens))
    assert [len(g.members) for g in pooled] == [6, 5] and [len(g.rewards) for g in pooled] == [3, 3]


def test_a_physical_sequence_without_loss_tokens_is_no_member_of_the_forest():
    """A sequence whose turns carry no loss (masks cleared) adds nothing to the loss: it is left out of the forest
    and of the counts; an episode without any loss token stays one member, a sample of its group."""
    tokens = block_tokens()
    shared = [Segment(BLOCKS[b][0], tokens[b]) for b in ("system", "task")]
    masked = Segment("assistant", tokens["a1"], loss_mask=np.zeros(len(tokens["a1"]), bool))
    episode = Trajectory([*shared, masked, Segment("tool", tokens["tool1"])])
    episode.evict([3], Segment("tool", tokens["evicted"]))
    episode.append(Segment("assistant", tokens["a2"]))
    assert len(episode.physical_sequences()) == 2  # both were contexts the policy wrote under
    [member] = episode_members(episode)
    assert member.num_loss_tokens == len(tokens["a2"])
    silent = Trajectory([*shared, masked])
    assert len(episode_members(silent)) == 1
    group = trajectory_group([episode, silent], [1.0, 0.0], LossConfig())
    assert len(group.members) == 2 and group.episodes == [0, 1]
    assert group.episode_loss_tokens() == [len(tokens["a2"]), 0]


def test_an_edited_episode_is_never_taken_as_one_sequence():
    trajectory = play(SCRIPTS[0], block_tokens())
    with pytest.raises(ValueError, match="edited its context .* it is 2 physical sequences"):
        Member.from_trajectory(trajectory)
    members = episode_members(trajectory)
    with pytest.raises(ValueError, match="2 episode indices for 3 members"):
        make_group([*members, members[0]], [1.0, 0.0], LossConfig(), episodes=[0, 1])
    with pytest.raises(ValueError, match=r"3 rewards for the episodes \[0, 1\]"):
        make_group(members, [1.0, 0.0, 0.5], LossConfig(), episodes=[0, 1])
