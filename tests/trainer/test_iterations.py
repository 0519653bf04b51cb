"""Several optimizer steps on the same rollouts (TRL's ``num_iterations``, μ), capture reuse across them (detached
mode), and the batch normalisation of the loss across groups (TRL's "dapo")."""

from __future__ import annotations

import copy

import pytest
import torch
from grpo_reference import advantages, flat, grpo_loss, parameter_grads, relative_l2, sequence_logprobs

from longstraw_agents.engine import Engine
from longstraw_agents.models.presets import forward_with_cache, returned_cache, tiny_model
from longstraw_agents.trainer import GRPOConfig, GRPOTrainer, LossConfig, backward_group, make_group
from longstraw_agents.trainer.group import Group, batch_weighted, completion_members, token_array
from longstraw_agents.trainer.modes import PrefixCache

PROMPT_LEN, CHUNK, G = 24, 8, 3
COMPLETION_LENGTHS = [[3, 5, 2], [6, 1, 4]]


def data(num_groups: int = 2, seed: int = 0) -> list[tuple[torch.Tensor, list[torch.Tensor], list[float]]]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for lengths in COMPLETION_LENGTHS[:num_groups]:
        prompt = torch.randint(0, 256, (PROMPT_LEN,), generator=generator)
        completions = [torch.randint(0, 256, (n,), generator=generator) for n in lengths]
        out.append((prompt, completions, torch.rand(G, generator=generator).tolist()))
    return out


def current_logprobs(model: torch.nn.Module, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """The policy's own log-probs of a completion (what a sampler with these weights records)."""
    engine = Engine(model, chunk_size=CHUNK)
    with torch.no_grad():
        logp = sequence_logprobs(lambda ids: engine.logits(engine.empty_state(), ids), torch.cat([prompt, completion]))
    return logp[PROMPT_LEN - 1 :]


def groups_for(trainer: GRPOTrainer, batch, behaviour: str = "shifted") -> list[Group]:
    """``behaviour``: "none", "exact" (the trainer's current log-probs) or "shifted" (those moved by noise, so the
    ratios are spread and some clipped)."""
    generator = torch.Generator().manual_seed(5)
    groups = []
    for prompt, completions, rewards in batch:
        old = None
        if behaviour != "none":
            old = [current_logprobs(trainer.engine.model, prompt, c) for c in completions]
            if behaviour == "shifted":
                old = [lp + 0.3 * torch.randn(lp.shape, generator=generator, dtype=lp.dtype) for lp in old]
        groups.append(trainer.group_from_completions(prompt, completions, rewards, old_logprobs=old))
    return groups


def make_trainer(mode: str = "exact", dtype: torch.dtype = torch.float32, **config) -> GRPOTrainer:
    config = {"G": G, "mode": mode, "chunk_size": CHUNK, "lr": 1e-2, "max_grad_norm": None, **config}
    return GRPOTrainer(tiny_model("llama", dtype=dtype, seed=0), GRPOConfig(**config))


def parameters(trainer: GRPOTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


# --- num_iterations ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "detached"])
def test_mu_steps_are_mu_optimizer_steps_on_the_same_groups(mode: str) -> None:
    """One train_step with μ = 3 applies exactly what three train_steps with μ = 1 on the same groups (ratio against
    the same behaviour log-probs) apply; the counters advance once."""
    batch = data()
    several = make_trainer(mode, num_iterations=3)
    metrics = several.train_step(groups_for(several, batch))
    single = make_trainer(mode)
    groups = groups_for(single, batch)
    singles = [single.train_step(groups) for _ in range(3)]
    assert parameters(several).keys() == parameters(single).keys()
    for name, value in parameters(several).items():
        assert torch.equal(value, parameters(single)[name]), name
    assert (several.step_count, several.policy_version, single.step_count) == (1, 1, 3)
    assert [it.loss for it in metrics.iterations] == [m.loss for m in singles]
    assert [it.grad_norm for it in metrics.iterations] == [m.grad_norm for m in singles]
    assert len({it.loss for it in metrics.iterations}) == 3  # the weights moved between the steps
    assert metrics.loss == metrics.iterations[0].loss
    assert metrics.forward_tokens == sum(it.forward_tokens for it in metrics.iterations)


def test_the_first_step_is_on_policy_when_the_behaviour_logprobs_come_from_the_same_weights() -> None:
    """With behaviour log-probs from the current weights, the first of μ steps has ratio 1: its loss is the
    on-policy constant -Σ A_i n_i / T and its gradient the on-policy gradient (fp64)."""
    batch = data(num_groups=1)
    several = make_trainer(dtype=torch.float64, num_iterations=2)
    metrics = several.train_step(groups_for(several, batch, behaviour="exact"))
    on_policy = make_trainer(dtype=torch.float64)
    expected = on_policy.train_step(groups_for(on_policy, batch, behaviour="none"))
    rewards, lengths = batch[0][2], [len(c) for c in batch[0][1]]
    constant = -float((advantages(rewards) * torch.tensor(lengths, dtype=torch.float64)).sum()) / sum(lengths)
    assert metrics.iterations[0].loss == pytest.approx(constant, abs=1e-12)
    assert metrics.iterations[0].grad_norm == pytest.approx(expected.grad_norm, rel=1e-9)
    assert metrics.iterations[1].loss != pytest.approx(constant, abs=1e-6)  # off-policy after the first update


def test_mu_above_one_needs_behaviour_logprobs_on_every_loss_token() -> None:
    trainer = make_trainer(num_iterations=2)
    with pytest.raises(ValueError, match=r"num_iterations=2 needs behaviour logprobs .* episode 0 of group 0"):
        trainer.train_step(groups_for(trainer, data(), behaviour="none"))
    assert trainer.step_count == 0
    make_trainer().train_step(groups_for(trainer, data(), behaviour="none"))  # μ = 1: on-policy is fine


def test_num_iterations_is_validated_and_round_trips() -> None:
    with pytest.raises(ValueError, match="num_iterations"):
        GRPOConfig(num_iterations=0)
    config = GRPOConfig(num_iterations=4, mode="detached", capture_reuse=True)
    assert GRPOConfig.model_validate_json(config.model_dump_json()) == config


# --- capture reuse -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "naive"])
def test_capture_reuse_is_refused_outside_detached_mode(mode: str) -> None:
    with pytest.raises(ValueError, match="capture_reuse needs mode='detached'"):
        GRPOConfig(mode=mode, capture_reuse=True, num_iterations=2)
    engine = Engine(tiny_model("llama"), chunk_size=CHUNK)
    group = groups_for(make_trainer(), data(num_groups=1), behaviour="none")[0]
    with pytest.raises(ValueError, match="cannot reuse a captured prefix"):
        backward_group(engine, group, mode, LossConfig(), prefix_cache=PrefixCache())


def test_a_reused_capture_with_unchanged_weights_gives_the_recaptured_gradient_exactly() -> None:
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    engine = Engine(model, chunk_size=CHUNK)
    group = groups_for(make_trainer(), data(num_groups=1), behaviour="none")[0]
    cache = PrefixCache()
    first = backward_group(engine, group, "detached", LossConfig(), prefix_cache=cache)
    captured = parameter_grads(model)
    model.zero_grad()
    again = backward_group(engine, group, "detached", LossConfig(), prefix_cache=cache)
    assert len(cache) == 1  # the shared prompt: the only interior node
    assert torch.equal(flat(parameter_grads(model)), flat(captured)) and again.loss == first.loss
    assert again.forward_tokens == first.forward_tokens - (PROMPT_LEN - 1)  # the prompt was not run again
    other = groups_for(make_trainer(), data(num_groups=1, seed=1), behaviour="none")[0]
    with pytest.raises(ValueError, match="one group's tree"):
        backward_group(engine, other, "detached", LossConfig(), prefix_cache=cache)


def test_after_an_update_the_reused_prefix_is_the_old_weights_prefix() -> None:
    """Reuse after the weights changed: the completion is scored by the new weights on top of the prompt's K/V from
    the old weights. Checked against transformers: the old model's DynamicCache of the prompt, then the new model's
    forward over the completion from that cache, and the reference loss (fp64)."""
    model = tiny_model("llama", dtype=torch.float64, seed=0)
    old_model = copy.deepcopy(model)
    engine = Engine(model, chunk_size=CHUNK)
    (prompt, completions, rewards) = data(num_groups=1)[0]
    group = make_group(completion_members(token_array(prompt, "prompt"), completions), rewards, LossConfig())
    cache = PrefixCache()
    backward_group(engine, group, "detached", LossConfig(), prefix_cache=cache)
    with torch.no_grad():  # an optimizer step, in place, as in the trainer
        generator = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator, dtype=p.dtype))
    model.zero_grad()
    reused = backward_group(engine, group, "detached", LossConfig(), prefix_cache=cache)
    reused_grads = parameter_grads(model)

    with torch.no_grad():
        prompt_cache = returned_cache(old_model(prompt[:-1].unsqueeze(0), use_cache=True))
    reference_model = copy.deepcopy(model)
    reference_model.zero_grad()
    logps = []
    for completion in completions:
        inputs = torch.cat([prompt[-1:], completion[:-1]])
        logits = forward_with_cache(reference_model, inputs.unsqueeze(0), copy.deepcopy(prompt_cache)).logits[0]
        logps.append(torch.log_softmax(logits, -1).gather(-1, completion[:, None])[:, 0])
    reference = grpo_loss(logps, [torch.ones(len(c), dtype=torch.bool) for c in completions], rewards).loss
    reference.backward()
    assert reused.loss == pytest.approx(float(reference.detach()), abs=1e-12)
    assert relative_l2(reused_grads, parameter_grads(reference_model)) < 1e-6  # transformers' fp32 casts: ~1e-7

    model.zero_grad()
    recaptured = backward_group(engine, group, "detached", LossConfig())
    assert relative_l2(reused_grads, parameter_grads(model)) > 1e-4  # reuse is an approximation after all
    assert recaptured.loss == pytest.approx(reused.loss, abs=1e-12)  # on-policy the value is the constant


def test_capture_reuse_in_the_trainer_is_exact_in_the_first_step_and_drifts_after() -> None:
    """Same start, same groups: the first optimizer step is identical, the later ones differ a little (at lr 1e-4
    the gradient norms by ~0.1 %) and run fewer tokens (the prompts are not captured again)."""
    batch = data()
    reuse = make_trainer("detached", num_iterations=3, capture_reuse=True, lr=1e-4)
    recapture = make_trainer("detached", num_iterations=3, lr=1e-4)
    with_reuse = reuse.train_step(groups_for(reuse, batch, behaviour="exact"))
    without = recapture.train_step(groups_for(recapture, batch, behaviour="exact"))
    first, again = with_reuse.iterations[0], without.iterations[0]
    assert (first.loss, first.grad_norm) == (again.loss, again.grad_norm)
    for k in (1, 2):
        assert with_reuse.iterations[k].grad_norm != without.iterations[k].grad_norm
        assert with_reuse.iterations[k].grad_norm == pytest.approx(without.iterations[k].grad_norm, rel=1e-2)
        assert without.iterations[k].forward_tokens == without.iterations[0].forward_tokens
        saved = without.iterations[k].forward_tokens - with_reuse.iterations[k].forward_tokens
        assert saved >= 2 * (PROMPT_LEN - 1)  # at least the two groups' prompts were captured once only


# --- batch normalisation -------------------------------------------------------------------------------------------
def test_batch_weights_pool_the_members_of_all_groups() -> None:
    trainer = make_trainer(loss_type="dapo")
    assert trainer.config.loss.normalization == "batch"
    groups = groups_for(trainer, data(), behaviour="none")
    total = sum(sum(lengths) for lengths in COMPLETION_LENGTHS)
    pooled = batch_weighted(groups, trainer.config.loss)
    assert [t.weight for g in pooled for t in g.terms] == pytest.approx([1 / total] * 2 * G)
    assert [t.advantage for g in pooled for t in g.terms] == [t.advantage for g in groups for t in g.terms]
    seq_mean = batch_weighted(groups, LossConfig(aggregation="grpo"))
    lengths = [n for group in COMPLETION_LENGTHS for n in group]
    assert [t.weight for g in seq_mean for t in g.terms] == pytest.approx([1 / (2 * G * n) for n in lengths])
    # data parallel: this process's members sit at an offset of a larger pool
    pool = [7, 7, *lengths]
    shifted = batch_weighted(groups, trainer.config.loss, pool, offset=2)
    assert [t.weight for g in shifted for t in g.terms] == pytest.approx([1 / (total + 14)] * 2 * G)
    with pytest.raises(ValueError, match="loss-token counts"):
        batch_weighted(groups, trainer.config.loss, pool, offset=0)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean", "dr-grpo"])
def test_batch_normalisation_sums_the_groups_shares_of_one_batch_loss(aggregation: str) -> None:
    """With normalization="batch" the step's gradient is Σ_g ∇(pooled loss restricted to g); with "group" it is
    the mean of the groups' own gradients. Token-mean and dr-grpo (L: the longest of the pool, or of each group)
    tell the two apart; seq-mean does not, with groups of equal size."""
    grads = {}
    for normalization in ("batch", "group"):
        trainer = make_trainer(aggregation=aggregation, normalization=normalization, max_completion_length=None)
        recorded: dict = {}
        trainer.optimizer.step = lambda *a, **k: recorded.update(parameter_grads(trainer.engine.model))  # noqa: B023
        groups = groups_for(trainer, data(), behaviour="none")
        with pytest.warns(UserWarning, match="lr_scheduler.step"):
            trainer.train_step(groups)
        grads[normalization] = recorded
        pooled = batch_weighted(groups, trainer.config.loss) if normalization == "batch" else groups
        expected = None
        for group in pooled:
            trainer.engine.model.zero_grad()
            backward_group(trainer.engine, group, "exact", trainer.config.loss, track_memory=False)
            g = flat(parameter_grads(trainer.engine.model))
            expected = g if expected is None else expected + g
        assert expected is not None
        if normalization == "group":
            expected = expected / len(groups)
        assert float((flat(recorded) - expected).norm() / expected.norm()) < 1e-6
    differs = relative_l2(grads["batch"], grads["group"])
    assert differs < 1e-6 if aggregation == "seq-mean" else differs > 1e-3
