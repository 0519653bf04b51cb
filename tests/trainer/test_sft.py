"""The supervised warm start (trainer/sft.py): one right-padded forward per batch gives each trajectory's own loss."""

from __future__ import annotations

import gymnasium
import pytest
import torch

from longstraw_agents.envs import ScriptedPolicy, run_episode
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.trainer.sft import SFTConfig, fused_attention, masked_nll, supervised_warm_start
from longstraw_agents.trajectory import Segment, Trajectory


def scripted_traces(count: int) -> list[Trajectory]:
    """Calculator word problems of 1-3 operations: trajectories of different lengths."""
    traces = []
    for k in range(count):
        env = gymnasium.make("LongStraw/Calculator-v0", num_operations=1 + k % 3)
        traces.append(run_episode(env, ScriptedPolicy(env), seed=k))
        env.close()
    return traces


def one_by_one(model: torch.nn.Module, trajectories: list[Trajectory]) -> tuple[torch.Tensor, int]:
    """The reference: each trajectory alone through the model's full forward."""
    total, count = torch.zeros((), dtype=torch.float64), 0
    for trajectory in trajectories:
        rendered = trajectory.render()
        ids = torch.tensor(rendered.token_ids)
        mask = torch.tensor(rendered.loss_mask[1:], dtype=torch.bool)
        logp = torch.log_softmax(model(ids[None, :-1]).logits[0].double(), -1)
        total = total - logp.gather(-1, ids[1:, None])[:, 0][mask].sum()
        count += int(mask.sum())
    return total, count


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_the_padded_batch_loss_and_gradient_equal_each_trajectory_alone(family: str) -> None:
    traces = scripted_traces(3)
    assert len({t.num_tokens for t in traces}) == 3  # the padding is exercised
    vocab = load_tokenizer("longstraw-bpe").vocab_size
    model = tiny_model(family, vocab_size=vocab, dtype=torch.float64, seed=0)
    total, count = masked_nll(model, traces)
    total.backward()
    batched = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    expected, expected_count = one_by_one(model, traces)
    expected.backward()
    assert count == expected_count
    assert float(total.detach()) == pytest.approx(float(expected.detach()), rel=1e-12)
    got = torch.cat([g.flatten() for g in batched])
    want = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert float((got - want).norm() / want.norm()) < 1e-6  # transformers computes its norms in fp32: ~1e-7


def test_the_warm_start_lowers_the_loss_on_its_traces() -> None:
    traces = scripted_traces(4)
    model = tiny_model("llama", vocab_size=load_tokenizer("longstraw-bpe").vocab_size, hidden=32, layers=1)
    losses = supervised_warm_start(model, traces, SFTConfig(steps=30, batch_size=4, lr=1e-2), progress=False)
    assert len(losses) == 30 and losses[-1] < 0.5 * losses[0]
    with pytest.raises(ValueError, match="no trajectories"):
        supervised_warm_start(model, [], SFTConfig(steps=1))


def test_an_edited_trajectory_is_learned_in_the_contexts_it_was_written_in() -> None:
    """An episode that evicted a tool output: each assistant turn's loss is taken in its own physical sequence, so
    the batch loss equals the hand-built sequences' loss (and differs from the segment log's)."""
    [trace] = scripted_traces(1)
    model = tiny_model("llama", vocab_size=load_tokenizer().vocab_size, dtype=torch.float64)
    tool = next(k for k, s in enumerate(trace.segments) if s.role == "tool")
    last = max(k for k, s in enumerate(trace.segments) if s.role == "assistant")
    edited = Trajectory(list(trace.segments[:last]))
    placeholder = Segment("tool", trace.segments[tool].token_ids[:2])
    edited.evict([tool], placeholder)
    edited.extend(trace.segments[last:])
    by_hand = [
        Trajectory(list(trace.segments[:last])),
        Trajectory(
            [Segment(s.role, s.token_ids, loss_mask=[False] * len(s)) for s in trace.segments[:tool]]
            + [placeholder]
            + [Segment(s.role, s.token_ids, loss_mask=[False] * len(s)) for s in trace.segments[tool + 1 : last]]
            + list(trace.segments[last:])
        ),
    ]
    with torch.no_grad():
        nll, count = masked_nll(model, [edited])
        expected, expected_count = one_by_one(model, by_hand)
        log, _ = one_by_one(model, [trace])
    assert count == expected_count == int(trace.loss_mask()[1:].sum())
    assert float(nll) == pytest.approx(float(expected), rel=1e-9)
    assert float(nll) != pytest.approx(float(log), rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "glm_moe_dsa"])
def test_the_warm_start_runs_fused_attention_and_gives_the_model_back_as_it_was(family: str) -> None:
    """Inside ``fused_attention`` the model runs torch's SDPA where transformers has it for the family (the warm
    start's long sequences: eager attention keeps [heads, T, T] for the backward), with the eager loss; after it,
    the model's own attention again (the engine and the tests read eager)."""
    traces = scripted_traces(2)
    model = tiny_model(family, vocab_size=load_tokenizer("longstraw-bpe").vocab_size, dtype=torch.float64)
    before = model.config._attn_implementation
    with torch.no_grad():
        eager, _ = masked_nll(model, traces)
        with fused_attention(model):
            inside = model.config._attn_implementation
            fused, _ = masked_nll(model, traces)
    assert model.config._attn_implementation == before == "eager"
    assert inside in ({"sdpa"} if family != "glm_moe_dsa" else {"sdpa", "eager"})
    assert float(fused) == pytest.approx(float(eager), rel=1e-7)  # (transformers takes some norms in fp32)


def test_a_model_not_on_eager_attention_keeps_its_own() -> None:
    model = tiny_model("llama", vocab_size=load_tokenizer("longstraw-bpe").vocab_size)
    model.set_attn_implementation("sdpa")
    with fused_attention(model):
        assert model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("flex_attention")
    with fused_attention(model):
        assert model.config._attn_implementation == "flex_attention"  # (no downgrade to SDPA)
    assert model.config._attn_implementation == "flex_attention"
