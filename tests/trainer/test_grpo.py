"""GRPO backward: the three execution modes against a plain full-graph reference, against each other, on segment
trees of multi-turn agent trajectories, and on bad input.

References (``tests/grpo_reference.py``) never touch the trainer: transformers' own forward per member, the
definition-based GLM-MoE-DSA forward of ``tests/reference_dsa.py`` (transformers' DSA is not causally consistent
when ``index_topk`` < context), and — where transformers' internal fp32 casts cap fp64 agreement near 1e-7 — the
engine's full-sequence forward from an empty state, which shares no code with the trainer's walks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from grpo_reference import (
    Reference,
    detached_prompt_logprobs,
    engine_logits,
    grpo_loss,
    parameter_grads,
    relative_l2,
    sequence_logprobs,
    target_logprobs,
    transformers_logits,
)
from recursion import shallow_stack
from reference_dsa import reference_logits as dsa_reference_logits
from torch import Tensor, nn

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.engine import kit as kit_module
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.state import Arena
from longstraw_agents.trainer import BackwardResult, LossConfig, grpo_backward, grpo_backward_trajectories, modes
from longstraw_agents.trajectory import Segment, Trajectory

FAMILIES = ["llama", "qwen3", "qwen3_5", "glm_moe_dsa"]
DTYPES = [torch.float32, torch.float64]
VOCAB = 256
CHUNK = 8
PROMPT_LEN = 30  # the context node covers the first 29 tokens (the 30th feeds the first completion target): 4 chunks
MODES = ["naive", "detached", "exact"]

# exact vs naive (the bar)
MODE_TOL = {torch.float32: 1e-5, torch.float64: 1e-9}
# trainer vs a transformers reference: transformers runs norms and rotary angles in fp32 even for fp64 models
TRANSFORMERS_TOL = {torch.float32: 1e-5, torch.float64: 1e-6}
# trainer vs a reference that computes in the model's dtype throughout (engine full forward, reference_dsa)
EXACT_REFERENCE_TOL = {torch.float32: 1e-5, torch.float64: 1e-9}
LOSS_TOL = {torch.float32: 1e-6, torch.float64: 1e-12}  # relative, on loss values (always summed in fp64)
# relative, on the mean k3 KL: k3(d) ~ d^2/2 of a log-prob difference, so fp32 rounding of d weighs more
KL_TOL = {torch.float32: 1e-4, torch.float64: 1e-10}


@functools.cache
def model(family: str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """A tiny random-init model; GLM-MoE-DSA keeps index_topk=8 < context so its sparse selection is exercised."""
    return tiny_model(family, dtype=dtype, seed=seed)


def reference_logits_fn(family: str, net: nn.Module, dtype: torch.dtype):
    """The most precise independent full-graph forward available for the family, and its tolerance."""
    if family == "glm_moe_dsa":
        return (lambda ids: dsa_reference_logits(net, ids)), EXACT_REFERENCE_TOL[dtype]
    return transformers_logits(net), TRANSFORMERS_TOL[dtype]


# --- groups ------------------------------------------------------------------------------------------------------
@dataclass
class PromptGroup:
    """One prompt shared by G completions whose first tokens differ (so members diverge right after the prompt)."""

    prompt: Tensor
    completions: list[Tensor]
    rewards: list[float]
    old_logprobs: list[Tensor | None] | None = None

    @property
    def masks(self) -> list[Tensor]:
        return [torch.ones(len(c), dtype=torch.bool) for c in self.completions]


def prompt_group(
    seed: int, lengths: tuple[int, ...] = (4, 6, 3), rewards: tuple[float, ...] = (1.0, 0.0, 0.5)
) -> PromptGroup:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=gen)
    firsts = torch.randperm(VOCAB, generator=gen)[: len(lengths)]
    completions = [
        torch.cat([first.view(1), torch.randint(0, VOCAB, (n - 1,), generator=gen)])
        for first, n in zip(firsts, lengths, strict=True)
    ]
    return PromptGroup(prompt, completions, list(rewards))


def completion_logprobs(logits_fn, group: PromptGroup, temperature: float = 1.0) -> list[Tensor]:
    """Per member: log p of its completion tokens from one full graph over prompt + completion."""
    start = len(group.prompt) - 1
    return [sequence_logprobs(logits_fn, torch.cat([group.prompt, c]), temperature)[start:] for c in group.completions]


def with_behaviour_logprobs(
    group: PromptGroup, logits_fn, spread: float = 0.6, seed: int = 0, temperature: float = 1.0
) -> PromptGroup:
    """Off-policy copy of the group: behaviour log-probs = current ones shifted by U(-spread, spread), so that the
    ratios exp(logp - old) fall on both sides of the clip range."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        current = completion_logprobs(logits_fn, group, temperature)
    old = [lp - (torch.rand(lp.shape, generator=gen, dtype=torch.float64) * 2 - 1) * spread for lp in current]
    return PromptGroup(group.prompt, group.completions, group.rewards, old)


@dataclass(frozen=True)
class Scenario:
    name: str
    loss: dict = field(default_factory=dict)  # LossConfig fields, also grpo_loss's keyword names
    off_policy: bool = True
    kl: bool = False
    temperature: float = 1.0  # LossConfig.temperature: log-probs of softmax(logits / T)


SCENARIOS = [
    Scenario("on-policy", off_policy=False),
    Scenario("clipped", {"epsilon": 0.2}),
    Scenario("clip-higher-seq-mean", {"epsilon": 0.2, "epsilon_high": 0.28, "aggregation": "seq-mean"}),
    Scenario("dr-grpo", {"aggregation": "dr-grpo", "scale_rewards": False, "max_completion_length": 12}),
    Scenario("dr-grpo-default-length", {"aggregation": "dr-grpo"}),  # TRL's fixed L = 256
    Scenario("dr-grpo-longest", {"aggregation": "dr-grpo", "max_completion_length": None}),
    Scenario("kl", {"beta": 0.1, "epsilon": 0.1}, kl=True),
    Scenario("temperature-kl", {"beta": 0.1}, kl=True, temperature=0.7),
    Scenario("truncated-importance", {"importance": "tis", "tis_cap": 1.3}),
]


def run_mode(net: nn.Module, group: PromptGroup, mode: str, scenario: Scenario, ref_model: nn.Module | None = None):
    """The trainer's loss statistics and parameter gradients for one group."""
    net.zero_grad(set_to_none=True)
    stats = grpo_backward(
        net,
        group.prompt,
        group.completions,
        group.rewards,
        mode=mode,
        config=LossConfig(**scenario.loss, temperature=scenario.temperature),
        old_logprobs=group.old_logprobs,
        ref_model=ref_model if scenario.kl else None,
        chunk_size=CHUNK,
    )
    return stats, parameter_grads(net)


def run_reference(
    net: nn.Module, logps_fn, group: PromptGroup, scenario: Scenario, ref_logits_fn=None
) -> tuple[Reference, dict[str, Tensor]]:
    """The reference loss and its gradients; ``logps_fn(group)`` gives each member's completion log-probs."""
    net.zero_grad(set_to_none=True)
    ref_logps = None
    if scenario.kl:
        with torch.no_grad():
            ref_logps = completion_logprobs(ref_logits_fn, group, scenario.temperature)
    result = grpo_loss(
        logps_fn(group), group.masks, group.rewards, old_logps=group.old_logprobs, ref_logps=ref_logps, **scenario.loss
    )
    result.loss.backward()
    return result, parameter_grads(net)


def assert_loss_close(actual: float, expected: float, tol: float) -> None:
    assert abs(actual - expected) <= tol * max(1.0, abs(expected)), (actual, expected)


# --- 1. the trainer against the reference --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["naive", "exact"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_matches_transformers_reference_fp32(scenario: Scenario, mode: str):
    net, ref_net = model("llama", torch.float32), model("llama", torch.float32, seed=1)
    logits_fn = transformers_logits(net)
    group = prompt_group(seed=1, lengths=(4, 7, 3, 5), rewards=(1.0, 0.0, 0.5, 2.0))
    if scenario.off_policy:
        group = with_behaviour_logprobs(group, logits_fn, temperature=scenario.temperature)
    logps_fn = functools.partial(completion_logprobs, logits_fn, temperature=scenario.temperature)
    expected, expected_grads = run_reference(net, logps_fn, group, scenario, transformers_logits(ref_net))
    stats, grads = run_mode(net, group, mode, scenario, ref_net)

    assert_loss_close(stats.loss, float(expected.loss.detach()), LOSS_TOL[torch.float32])
    assert relative_l2(grads, expected_grads) <= TRANSFORMERS_TOL[torch.float32]
    if scenario.kl:
        assert stats.kl == pytest.approx(expected.kl, rel=KL_TOL[torch.float32])
    else:
        assert stats.kl is None
    assert stats.loss_tokens == sum(len(c) for c in group.completions)
    assert stats.prompt_tokens == PROMPT_LEN
    assert stats.unique_tokens == PROMPT_LEN + sum(len(c) for c in group.completions)
    assert stats.num_members == 4 and stats.mode == mode


@pytest.mark.parametrize("mode", ["naive", "exact"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_matches_full_forward_reference_fp64(scenario: Scenario, mode: str):
    """fp64 to 1e-9: the reference's log-probs come from the engine's full-sequence forward (one graph from an
    empty state), since transformers' fp32 casts would cap agreement near 1e-7."""
    net, ref_net = model("llama", torch.float64), model("llama", torch.float64, seed=1)
    logits_fn = engine_logits(Engine(net))
    group = prompt_group(seed=2, lengths=(5, 2, 6), rewards=(0.0, 1.0, 3.0))
    if scenario.off_policy:
        group = with_behaviour_logprobs(group, logits_fn, seed=1, temperature=scenario.temperature)
    logps_fn = functools.partial(completion_logprobs, logits_fn, temperature=scenario.temperature)
    expected, expected_grads = run_reference(net, logps_fn, group, scenario, engine_logits(Engine(ref_net)))
    stats, grads = run_mode(net, group, mode, scenario, ref_net)

    assert_loss_close(stats.loss, float(expected.loss.detach()), LOSS_TOL[torch.float64])
    assert relative_l2(grads, expected_grads) <= 1e-9
    if scenario.kl:
        assert stats.kl == pytest.approx(expected.kl, rel=KL_TOL[torch.float64])


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("qwen3_5", torch.float32), ("glm_moe_dsa", torch.float64)],
    ids=["qwen3_5-float32", "glm_moe_dsa-float64"],
)
def test_matches_reference_other_families(family: str, dtype: torch.dtype):
    net, ref_net = model(family, dtype), model(family, dtype, seed=1)
    logits_fn, tol = reference_logits_fn(family, net, dtype)
    ref_logits_fn, _ = reference_logits_fn(family, ref_net, dtype)
    scenario = Scenario("kl-clip-higher", {"beta": 0.05, "epsilon": 0.2, "epsilon_high": 0.3}, kl=True)
    group = with_behaviour_logprobs(prompt_group(seed=3), logits_fn, seed=2)
    expected, expected_grads = run_reference(
        net, functools.partial(completion_logprobs, logits_fn), group, scenario, ref_logits_fn
    )
    stats, grads = run_mode(net, group, "exact", scenario, ref_net)
    assert_loss_close(stats.loss, float(expected.loss.detach()), max(tol, LOSS_TOL[dtype]))
    assert relative_l2(grads, expected_grads) <= tol


def test_reference_batches_exercise_clipping_and_the_on_policy_constant():
    """Guards the reference tests themselves: the off-policy batch really has clipped tokens on both sides (a trainer
    ignoring the clip would fail), and on-policy the loss value is the constant -Σ A_i n_i / T (DESIGN.md), so only
    gradients can tell a right on-policy loss from a wrong one."""
    net = model("llama", torch.float32)
    logits_fn = transformers_logits(net)
    group = prompt_group(seed=1, lengths=(4, 7, 3, 5), rewards=(1.0, 0.0, 0.5, 2.0))
    off = with_behaviour_logprobs(group, logits_fn)
    logps_fn = functools.partial(completion_logprobs, logits_fn)

    with torch.no_grad():
        ratio = torch.cat([torch.exp(lp - old) for lp, old in zip(logps_fn(off), off.old_logprobs, strict=True)])
    assert (ratio < 0.8).any() and (ratio > 1.2).any() and ((ratio > 0.8) & (ratio < 1.2)).any()

    _, clipped = run_reference(net, logps_fn, off, Scenario("clip", {"epsilon": 0.2}))
    _, unclipped = run_reference(net, logps_fn, off, Scenario("no-clip", {"epsilon": 1e6}))
    assert relative_l2(clipped, unclipped) > 1e-2
    _, capped = run_reference(net, logps_fn, off, Scenario("tis", {"importance": "tis", "tis_cap": 1.3}))
    _, uncapped = run_reference(net, logps_fn, off, Scenario("tis", {"importance": "tis", "tis_cap": 1e6}))
    assert relative_l2(capped, uncapped) > 1e-2

    on_policy, _ = run_reference(net, logps_fn, group, Scenario("on", off_policy=False))
    r = torch.tensor(group.rewards, dtype=torch.float64)
    adv = (r - r.mean()) / (r.std() + 1e-4)
    lengths = torch.tensor([len(c) for c in group.completions], dtype=torch.float64)
    assert float(on_policy.loss.detach()) == pytest.approx(float(-(adv * lengths).sum() / lengths.sum()), rel=1e-12)
    stats, _ = run_mode(net, group, "exact", Scenario("on", off_policy=False))
    assert stats.loss == pytest.approx(float(on_policy.loss.detach()), rel=1e-12)


# --- 2. the modes against each other, every family, fp32 and fp64 --------------------------------------------------
MODE_SCENARIO = Scenario("modes", {"epsilon": 0.2, "epsilon_high": 0.28, "beta": 0.05}, kl=True)


@functools.cache
def mode_group(family: str, dtype: torch.dtype) -> PromptGroup:
    logits_fn = engine_logits(Engine(model(family, dtype)))
    return with_behaviour_logprobs(prompt_group(seed=4), logits_fn, spread=0.4, seed=3)


@functools.cache
def mode_runs(family: str, dtype: torch.dtype) -> dict[str, tuple[BackwardResult, dict[str, Tensor]]]:
    """All three modes on one off-policy group with clipping and KL (computed once per family and dtype)."""
    net, ref_net = model(family, dtype), model(family, dtype, seed=1)
    group = mode_group(family, dtype)
    return {mode: run_mode(net, group, mode, MODE_SCENARIO, ref_net) for mode in MODES}


FAMILY_DTYPES = [(f, d) for f in FAMILIES for d in DTYPES]
FAMILY_DTYPE_IDS = [f"{f}-{str(d).removeprefix('torch.')}" for f, d in FAMILY_DTYPES]
family_dtype = pytest.mark.parametrize(("family", "dtype"), FAMILY_DTYPES, ids=FAMILY_DTYPE_IDS)


@family_dtype
def test_exact_gradient_equals_naive(family: str, dtype: torch.dtype):
    runs = mode_runs(family, dtype)
    assert relative_l2(runs["exact"][1], runs["naive"][1]) <= MODE_TOL[dtype]


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_equals_naive_with_the_eager_attention_backend(family: str):
    """The modes' agreement holds whichever attention backend runs (the default, "auto", is a fused kernel)."""
    net, ref_net = model(family, torch.float64), model(family, torch.float64, seed=1)
    group = mode_group(family, torch.float64)
    grads = {}
    for mode in ("naive", "exact"):
        net.zero_grad(set_to_none=True)
        engine = Engine(net, EngineConfig(chunk_size=CHUNK, attention="eager", max_score_elements=64))
        grpo_backward(
            engine, group.prompt, group.completions, group.rewards, mode, config=LossConfig(**MODE_SCENARIO.loss),
            old_logprobs=group.old_logprobs, ref_model=ref_net,
        )  # fmt: skip
        grads[mode] = parameter_grads(net)
    assert relative_l2(grads["exact"], grads["naive"]) <= MODE_TOL[torch.float64]
    assert relative_l2(grads["exact"], mode_runs(family, torch.float64)["exact"][1]) <= MODE_TOL[torch.float64]


@family_dtype
def test_loss_identical_in_all_modes(family: str, dtype: torch.dtype):
    runs = mode_runs(family, dtype)
    naive = runs["naive"][0]
    for mode in ("detached", "exact"):
        stats = runs[mode][0]
        assert_loss_close(stats.loss, naive.loss, LOSS_TOL[dtype])
        assert stats.kl == pytest.approx(naive.kl, rel=KL_TOL[dtype])
        assert stats.loss_tokens == naive.loss_tokens


@family_dtype
def test_detached_mode_drops_the_prefix_gradient(family: str, dtype: torch.dtype):
    runs = mode_runs(family, dtype)
    assert relative_l2(runs["detached"][1], runs["naive"][1]) > 1e-2


def detached_reference_logps(family: str, net: nn.Module):
    """Completion log-probs with the prompt as a constant, computed without the trainer.

    Dense families: transformers' DynamicCache (prompt under no_grad, a deep copy per member). The hybrid cache
    updates its recurrent state in place (autograd refuses it) and transformers' DSA is inconsistent for
    index_topk < context, so those use the engine: capture the prompt, then ``logits`` of the branch.
    """
    if family in ("llama", "qwen3"):
        return lambda g: [detached_prompt_logprobs(net, g.prompt, c) for c in g.completions]
    engine = Engine(net, chunk_size=CHUNK)

    def logps(g: PromptGroup) -> list[Tensor]:
        state = engine.capture(g.prompt[:-1])
        return [target_logprobs(engine.logits(state, torch.cat([g.prompt[-1:], c[:-1]])), c) for c in g.completions]

    return logps


@family_dtype
def test_detached_mode_equals_independent_detached_reference(family: str, dtype: torch.dtype):
    net, ref_net = model(family, dtype), model(family, dtype, seed=1)
    group = mode_group(family, dtype)
    ref_logits_fn = engine_logits(Engine(ref_net))
    expected, expected_grads = run_reference(
        net, detached_reference_logps(family, net), group, MODE_SCENARIO, ref_logits_fn
    )
    stats, grads = mode_runs(family, dtype)["detached"]
    tol = TRANSFORMERS_TOL[dtype] if family in ("llama", "qwen3") else EXACT_REFERENCE_TOL[dtype]
    assert relative_l2(grads, expected_grads) <= tol
    assert_loss_close(stats.loss, float(expected.loss.detach()), max(tol, LOSS_TOL[dtype]))


@pytest.mark.parametrize("family", FAMILIES)
def test_loss_nodes_longer_than_a_chunk_are_walked_chunk_by_chunk(family: str):
    """Completions of 5-9 tokens with chunks of 3: the branches are captured without a graph and recomputed chunk by
    chunk with their loss (exact: into the prefix too; detached: within the branch only) — the same gradients as
    the one-graph replay with chunks longer than any completion."""
    net, ref_net = model(family, torch.float64), model(family, torch.float64, seed=1)
    group = with_behaviour_logprobs(prompt_group(seed=6, lengths=(9, 5, 7)), engine_logits(Engine(net)), seed=4)

    def grads(mode: str, chunk: int) -> dict[str, Tensor]:
        net.zero_grad(set_to_none=True)
        grpo_backward(
            net, group.prompt, group.completions, group.rewards, mode, config=LossConfig(**MODE_SCENARIO.loss),
            old_logprobs=group.old_logprobs, ref_model=ref_net, chunk_size=chunk,
        )  # fmt: skip
        return parameter_grads(net)

    naive = grads("naive", 64)
    assert relative_l2(grads("exact", 3), naive) <= MODE_TOL[torch.float64]
    assert relative_l2(grads("detached", 3), grads("detached", 64)) <= MODE_TOL[torch.float64]


@pytest.mark.parametrize("family", FAMILIES)
def test_exact_mode_is_exact_at_every_graph_budget(family: str):
    """Kept capture graphs replace recomputation (the last chunks first) without changing the gradient: no budget
    (recompute everything), budgets for part of the prefix, and one for all of it."""
    net, ref_net = model(family, torch.float64), model(family, torch.float64, seed=1)
    group = mode_group(family, torch.float64)
    naive = mode_runs(family, torch.float64)["naive"][1]
    recomputed = {}
    for budget in (0, 50_000, 200_000, 800_000, 3_200_000, 1 << 40):
        net.zero_grad(set_to_none=True)
        engine = Engine(net, EngineConfig(chunk_size=CHUNK, graph_budget_bytes=budget))
        stats = grpo_backward(
            engine, group.prompt, group.completions, group.rewards, "exact", config=LossConfig(**MODE_SCENARIO.loss),
            old_logprobs=group.old_logprobs, ref_model=ref_net,
        )  # fmt: skip
        recomputed[budget] = stats.forward_tokens
        assert relative_l2(parameter_grads(net), naive) <= MODE_TOL[torch.float64], budget
    counts = list(recomputed.values())
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]  # less recomputation as budgets grow
    assert any(counts[0] > c > counts[-1] for c in counts)  # some budget keeps part of the prefix


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_changes_no_gradient(family: str):
    """Layers recomputed in backward (branch replays and the reverse walk's chunks) give the same exact gradient."""
    net, ref_net = model(family, torch.float64), model(family, torch.float64, seed=1)
    group = mode_group(family, torch.float64)
    net.zero_grad(set_to_none=True)
    engine = Engine(net, EngineConfig(chunk_size=CHUNK, activation_checkpointing=True))
    grpo_backward(
        engine, group.prompt, group.completions, group.rewards, "exact", config=LossConfig(**MODE_SCENARIO.loss),
        old_logprobs=group.old_logprobs, ref_model=ref_net,
    )  # fmt: skip
    naive = mode_runs(family, torch.float64)["naive"][1]
    assert relative_l2(parameter_grads(net), naive) <= MODE_TOL[torch.float64]


def test_gradients_accumulate_into_existing_grads():
    """grpo_backward adds to param.grad (as loss.backward does); it never zeroes or steps."""
    net = model("llama", torch.float32)
    group = prompt_group(seed=5)
    net.zero_grad(set_to_none=True)
    for _ in range(2):
        grpo_backward(net, group.prompt, group.completions, group.rewards, mode="exact", chunk_size=CHUNK)
    twice = parameter_grads(net)
    _, once = run_mode(net, group, "exact", Scenario("on", off_policy=False))
    doubled = {name: 2 * g for name, g in once.items()}
    assert relative_l2(twice, doubled) <= 1e-6


# --- 3. the tree form: multi-turn agent trajectories ----------------------------------------------------------------
def agent_group(seed: int = 0) -> list[Trajectory]:
    """Five rollouts of a two-turn agent diverging at different depths.

    m0, m1: same first answer and tool output, different final answers (diverge in turn 2);
    m2: same first answer, a different tool output (diverges at the tool);
    m3: a different first answer (diverges right after the prompt);
    m4: the first answer and nothing more (a strict prefix of m0..m2).
    The first answer is a loss node shared by m0, m1, m2, m4. First tokens at every divergence are distinct.
    """
    rng = np.random.default_rng(seed)

    def ids(n: int, first: int) -> np.ndarray:
        out = rng.integers(0, VOCAB, n)
        out[0] = first
        return out

    system, user = ids(12, 9), ids(14, 8)
    answer, search, other_search, alternative = ids(5, 1), ids(9, 2), ids(7, 3), ids(6, 7)
    finals = [ids(4, 4), ids(6, 5), ids(3, 6)]

    def rollout(*parts: tuple[str, np.ndarray]) -> Trajectory:
        prompt = [Segment("system", system), Segment("user", user, turn=0)]
        return Trajectory(prompt + [Segment(role, tokens, turn=1 + k // 2) for k, (role, tokens) in enumerate(parts)])

    return [
        rollout(("assistant", answer), ("tool", search), ("assistant", finals[0])),
        rollout(("assistant", answer), ("tool", search), ("assistant", finals[1])),
        rollout(("assistant", answer), ("tool", other_search), ("assistant", finals[2])),
        rollout(("assistant", alternative)),
        rollout(("assistant", answer)),
    ]


AGENT_REWARDS = [1.0, 0.0, 0.25, 0.75, 0.5]
AGENT_UNIQUE_TOKENS = 12 + 14 + 5 + 9 + 7 + 6 + 4 + 6 + 3  # every trie position once


def member_logprobs(logits_fn, trajectories: list[Trajectory]) -> list[Tensor]:
    return [sequence_logprobs(logits_fn, torch.as_tensor(t.token_ids(), dtype=torch.long)) for t in trajectories]


def with_segment_logprobs(
    trajectories: list[Trajectory], logits_fn, on_policy: set[int], spread: float = 0.5
) -> list[Trajectory]:
    """Behaviour log-probs on every assistant segment (each member its own, also on shared tokens), except for the
    members in ``on_policy``."""
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        current = member_logprobs(logits_fn, trajectories)
    out = []
    for k, (traj, lp) in enumerate(zip(trajectories, current, strict=True)):
        row = np.concatenate([[np.nan], lp.numpy()])  # aligned with token ids: position 0 is never predicted
        segments, pos = [], 0
        for seg in traj:
            logprobs = None
            if seg.role == "assistant" and k not in on_policy:
                shift = (torch.rand(len(seg), generator=gen, dtype=torch.float64) * 2 - 1) * spread
                logprobs = row[pos : pos + len(seg)] - shift.numpy()
            segments.append(Segment(seg.role, seg.token_ids, logprobs=logprobs, turn=seg.turn))
            pos += len(seg)
        out.append(Trajectory(segments))
    return out


def tree_reference(net: nn.Module, logits_fn, trajectories: list[Trajectory], rewards, loss: dict):
    net.zero_grad(set_to_none=True)
    rendered = [t.render() for t in trajectories]
    olds = [
        torch.as_tensor(r.logprobs[1:], dtype=torch.float64) if any(s.has_logprobs for s in r.spans) else None
        for r in rendered
    ]
    masks = [torch.as_tensor(r.loss_mask[1:]) for r in rendered]
    result = grpo_loss(member_logprobs(logits_fn, trajectories), masks, rewards, old_logps=olds, **loss)
    result.loss.backward()
    return result, parameter_grads(net)


def run_tree(net: nn.Module, trajectories, mode: str, loss: dict):
    net.zero_grad(set_to_none=True)
    stats = grpo_backward_trajectories(
        net, trajectories, AGENT_REWARDS, mode=mode, config=LossConfig(**loss), chunk_size=CHUNK
    )
    return stats, parameter_grads(net)


TREE_CASES = [
    ("llama", torch.float64),
    ("qwen3_5", torch.float32),
    ("qwen3_5", torch.float64),
    ("glm_moe_dsa", torch.float64),
]


@pytest.mark.parametrize(("family", "dtype"), TREE_CASES, ids=[f"{f}-{str(d)[6:]}" for f, d in TREE_CASES])
def test_tree_form_exact_equals_naive_and_reference(family: str, dtype: torch.dtype):
    net = model(family, dtype)
    logits_fn, tol = reference_logits_fn(family, net, dtype)
    loss = {"epsilon": 0.2, "epsilon_high": 0.28}
    trajectories = with_segment_logprobs(agent_group(), logits_fn, on_policy={3})
    runs = {mode: run_tree(net, trajectories, mode, loss) for mode in MODES}
    expected, expected_grads = tree_reference(net, logits_fn, trajectories, AGENT_REWARDS, loss)

    assert relative_l2(runs["exact"][1], runs["naive"][1]) <= MODE_TOL[dtype]
    assert relative_l2(runs["exact"][1], expected_grads) <= tol
    assert relative_l2(runs["detached"][1], runs["naive"][1]) > 1e-2
    for mode in MODES:
        assert_loss_close(runs[mode][0].loss, runs["naive"][0].loss, LOSS_TOL[dtype])
    assert_loss_close(runs["exact"][0].loss, float(expected.loss.detach()), max(tol, LOSS_TOL[dtype]))


def test_tree_form_counts_shared_tokens_once():
    net = model("llama", torch.float64)
    trajectories = agent_group()
    stats = {mode: run_tree(net, trajectories, mode, {})[0] for mode in MODES}
    total = sum(t.num_tokens for t in trajectories)
    loss_tokens = sum(int(t.loss_mask()[1:].sum()) for t in trajectories)
    for s in stats.values():
        assert s.unique_tokens == AGENT_UNIQUE_TOKENS < total
        assert s.loss_tokens == loss_tokens  # the shared first answer still counts once per member in the loss
        assert s.num_members == 5
    assert stats["naive"].forward_tokens == total - len(trajectories)  # every member from scratch
    assert stats["detached"].forward_tokens < stats["naive"].forward_tokens  # the shared context once


def test_tree_form_takes_rewards_from_trajectories():
    net = model("llama", torch.float64)
    trajectories = agent_group()
    for traj, reward in zip(trajectories, AGENT_REWARDS, strict=True):
        traj.reward = reward
    net.zero_grad(set_to_none=True)
    stats = grpo_backward_trajectories(net, trajectories, mode="exact", chunk_size=CHUNK)
    implicit = parameter_grads(net)
    explicit_stats, explicit = run_tree(net, trajectories, "exact", {})
    assert list(stats.rewards) == AGENT_REWARDS and stats.loss == explicit_stats.loss
    assert relative_l2(implicit, explicit) == 0.0

    trajectories[2].reward = None
    with pytest.raises(ValueError, match=r"trajectories \[2\] have no reward"):
        grpo_backward_trajectories(net, trajectories, mode="exact")


def test_tree_form_follows_segment_loss_masks():
    """Loss masks come from the segments: tool and prompt tokens never carry loss, and a member may mask part of a
    shared answer (m0 drops its last two answer tokens, m3 masks its whole answer) — the tree then splits the shared
    node at the mask boundary and still equals the full-graph reference computed with the same masks."""
    net = model("llama", torch.float64)
    trajectories = agent_group()
    for r in (t.render() for t in trajectories):
        by_role = np.concatenate([np.full(span.end - span.start, span.role == "assistant") for span in r.spans])
        assert np.array_equal(r.loss_mask, by_role)

    def remask(traj: Trajectory, segment: int, mask: np.ndarray) -> Trajectory:
        segments = list(traj.segments)
        seg = segments[segment]
        segments[segment] = Segment(seg.role, seg.token_ids, loss_mask=mask, turn=seg.turn)
        return Trajectory(segments)

    masked = list(trajectories)
    masked[0] = remask(masked[0], 2, np.array([1, 1, 1, 0, 0], bool))
    masked[3] = remask(masked[3], 2, np.zeros(6, bool))
    stats, grads = run_tree(net, masked, "exact", {})
    expected, expected_grads = tree_reference(net, engine_logits(Engine(net)), masked, AGENT_REWARDS, {})
    assert stats.loss_tokens == sum(int(t.loss_mask()[1:].sum()) for t in trajectories) - 2 - 6
    assert_loss_close(stats.loss, float(expected.loss.detach()), LOSS_TOL[torch.float64])
    assert relative_l2(grads, expected_grads) <= 1e-9
    _, naive_grads = run_tree(net, masked, "naive", {})
    assert relative_l2(grads, naive_grads) <= MODE_TOL[torch.float64]


# --- 4. deep trees: many short turns ------------------------------------------------------------------------------
def many_turns(turns: int, seed: int = 0) -> list[Trajectory]:
    """Two rollouts sharing ``turns`` one-token segments (assistant and tool alternate), diverging in the final
    answer: the prefix tree is a chain of ``turns + 1`` nodes above two leaves."""
    rng = np.random.default_rng(seed)
    shared = [Segment("user", rng.integers(0, VOCAB, 3), turn=0)]
    for k, token in enumerate(rng.integers(0, VOCAB, turns).tolist()):
        shared.append(Segment("tool" if k % 2 else "assistant", [token], turn=1 + k // 2))
    return [Trajectory([*shared, Segment("assistant", [last, 9], turn=turns)]) for last in (1, 2)]


def test_a_thousand_turn_tree_runs_and_exact_equals_naive():
    """Exact mode fuses the chain of short turns into one node (one forward per chunk, not per turn)."""
    net = model("llama", torch.float64)
    trajectories = many_turns(1000)
    runs = {}
    for mode in ("naive", "exact"):
        net.zero_grad(set_to_none=True)
        stats = grpo_backward_trajectories(net, trajectories, [1.0, 0.0], mode=mode, chunk_size=64, track_memory=False)
        runs[mode] = stats, parameter_grads(net)
    exact = runs["exact"][0]
    assert exact.unique_tokens == 3 + 1000 + 2 * 2 and exact.nodes == 3
    assert relative_l2(runs["exact"][1], runs["naive"][1]) <= MODE_TOL[torch.float64]
    assert_loss_close(exact.loss, runs["naive"][0].loss, LOSS_TOL[torch.float64])


@pytest.mark.parametrize("mode", ["detached", "exact"])
def test_the_walk_is_iterative_and_a_chain_lands_in_one_arena_per_layer(mode: str, monkeypatch):
    """Node by node (exact mode without fusing, as detached mode always runs): no recursion however deep the tree,
    and the chain's extends append into the storage its first extend reserved, so attention reads one block."""
    monkeypatch.setattr(modes.ExactMode, "tree", modes.TreeMode.tree)
    arenas = []

    class CountedArena(Arena):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            arenas.append(self)

    monkeypatch.setattr(kit_module, "Arena", CountedArena)
    net = model("llama", torch.float64)
    trajectories = many_turns(300)
    net.zero_grad(set_to_none=True)
    with shallow_stack(150):  # the tree is 302 nodes deep
        stats = grpo_backward_trajectories(
            net, trajectories, [1.0, 0.0], mode=mode, chunk_size=CHUNK, track_memory=False
        )
    grads = parameter_grads(net)
    assert stats.nodes == 300 + 3
    assert len(arenas) == net.config.num_hidden_layers  # one per attention layer: the chain, then two leaves
    net.zero_grad(set_to_none=True)
    grpo_backward_trajectories(net, trajectories, [1.0, 0.0], mode="naive", track_memory=False)
    if mode == "exact":
        assert relative_l2(grads, parameter_grads(net)) <= MODE_TOL[torch.float64]
    else:
        assert relative_l2(grads, parameter_grads(net)) > 1e-2


# --- 8. bad input ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"prompt_ids": torch.zeros(0, dtype=torch.long)}, ValueError, "prompt_ids is empty"),
        ({"completions": []}, ValueError, "completions is empty"),
        ({"completions": [torch.tensor([1, 2]), torch.zeros(0, dtype=torch.long)]}, ValueError, "completion 1"),
        ({"rewards": [1.0, 0.0, 2.0]}, ValueError, "3 rewards for 2 members"),
        ({"rewards": [1.0, float("nan")]}, ValueError, "rewards must be finite"),
        ({"mode": "full"}, ValueError, "unknown mode 'full'"),
        ({"prompt_ids": torch.tensor([1.0, 2.0])}, TypeError, "integers"),
        ({"completions": [torch.tensor([1.5]), torch.tensor([2])]}, TypeError, "integers"),
        ({"prompt_ids": torch.tensor([[1, 2]])}, ValueError, "1-D"),
        ({"prompt_ids": torch.tensor([1, VOCAB])}, ValueError, r"token ids must be in \[0, 256\)"),
        ({"old_logprobs": [[0.0], [0.0, 0.0]]}, ValueError, "1 behaviour logprobs for a completion of 2 tokens"),
        ({"config": LossConfig(beta=0.1)}, ValueError, "reference model"),
        # float and bool token ids are refused, never truncated ([3.9, 4.0] is not [3, 4])
        ({"prompt_ids": [3.9, 4.0]}, TypeError, "prompt_ids: token ids must be integers, got dtype float64"),
        ({"prompt_ids": np.array([3.0, 4.0], np.float32)}, TypeError, "integers, got dtype float32"),
        ({"completions": [[1, 2], [6.5]]}, TypeError, "completion 1: token ids must be integers"),
        ({"completions": [torch.tensor([True, False]), torch.tensor([6])]}, TypeError, "completion 0: .* bool"),
        ({"completions": [[1, 2], [[6, 7]]]}, ValueError, r"completion 1: expected a 1-D sequence, got shape \(1, 2\)"),
        ({"completions": torch.tensor([[1, 2], [6, 7]])}, TypeError, r"list of G 1-D token tensors.*shape \(2, 2\)"),
        ({"old_logprobs": [[0.0, 0.0]]}, ValueError, "old_logprobs has 1 entries for 2 completions"),
        ({"old_logprobs": [None, None, None]}, ValueError, "old_logprobs has 3 entries for 2 completions"),
        ({"old_logprobs": [["a", "b"], None]}, TypeError, "old_logprobs\\[0\\]: expected real numbers"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, error, match):
    net = model("llama", torch.float32)
    args = {
        "prompt_ids": torch.tensor([3, 4, 5]),
        "completions": [torch.tensor([1, 2]), torch.tensor([6, 7])],
        "rewards": [1.0, 0.0],
        "mode": "exact",
        **kwargs,
    }
    net.zero_grad(set_to_none=True)
    with pytest.raises(error, match=match):
        grpo_backward(net, **args)
    assert all(p.grad is None for p in net.parameters()), "a rejected call must not touch the gradients"


def test_trajectories_without_any_loss_token_are_rejected():
    net = model("llama", torch.float32)
    context_only = [Trajectory([Segment("user", [1, 2, 3]), Segment("tool", [4, 5])]) for _ in range(2)]
    with pytest.raises(ValueError, match="no member has a loss token"):
        grpo_backward_trajectories(net, context_only, [1.0, 0.0])


@pytest.mark.parametrize("importance", ["ratio", "tis"])
def test_behaviour_logprobs_over_fused_context_and_members_without_them(importance: str):
    """Off-policy loss on a deep chain: exact mode fuses assistant and tool turns into one node (tool tokens have no
    behaviour logprob), and one member was sampled without logprobs. Unknown logprobs read as on-policy, so the
    loss and gradient stay finite and exact still equals naive and the full-graph reference."""
    net = model("llama", torch.float64)
    logits_fn, tol = reference_logits_fn("llama", net, torch.float64)
    trajectories = with_segment_logprobs(many_turns(40), logits_fn, on_policy={1})
    loss = {"epsilon": 0.2, "importance": importance, "tis_cap": 1.2}
    runs = {}
    for mode in MODES:
        net.zero_grad(set_to_none=True)
        stats = grpo_backward_trajectories(
            net, trajectories, [1.0, 0.0], mode=mode, config=LossConfig(**loss), chunk_size=CHUNK, track_memory=False
        )
        runs[mode] = stats, parameter_grads(net)
    assert runs["exact"][0].nodes < 40  # the chain was fused
    for stats, grads in runs.values():
        assert math.isfinite(stats.loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert relative_l2(runs["exact"][1], runs["naive"][1]) <= MODE_TOL[torch.float64]
    _, expected = tree_reference(net, logits_fn, trajectories, [1.0, 0.0], loss)
    assert relative_l2(runs["exact"][1], expected) <= tol
