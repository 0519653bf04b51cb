"""The GRPO objective piece by piece: advantages, aggregation weights, the clipped ratio, the k3 KL, the config."""

from __future__ import annotations

import math

import pydantic
import pytest
import torch

from longstraw_agents.trainer.loss import (
    AGGREGATIONS,
    LOSSES,
    GRPOLoss,
    IcePopLoss,
    LossConfig,
    RatioLoss,
    TISLoss,
    clip_fraction,
    group_advantages,
    k3_kl,
    token_logprobs,
)


def per_token(logp, advantage, config: LossConfig, old_logp=None, ref_logp=None) -> torch.Tensor:
    """The per-token loss of the objective ``config`` selects (its metrics dropped)."""
    loss, _ = GRPOLoss.from_config(config)(logp, advantage, old_logp, ref_logp)
    return loss


# --- advantages ----------------------------------------------------------------------------------------------------
def test_advantages_are_centred_and_scaled_by_the_unbiased_std_plus_1e_4():
    rewards = [1.0, 0.0, 0.5, 2.0]
    mean = sum(rewards) / 4
    unbiased_std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)
    expected = [(r - mean) / (unbiased_std + 1e-4) for r in rewards]
    assert group_advantages(rewards).tolist() == pytest.approx(expected, rel=1e-14)
    biased_std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 4)
    assert group_advantages(rewards)[0] != pytest.approx((1.0 - mean) / (biased_std + 1e-4), rel=1e-6)


def test_advantages_without_scaling_are_only_centred():
    assert group_advantages([3.0, 1.0, 2.0], scale=False).tolist() == [1.0, -1.0, 0.0]


def test_equal_rewards_and_single_members_have_zero_advantage():
    # the mean of 0.7s is not exact in binary, hence abs (TRL's formula: ~1e-16 / 1e-4)
    assert group_advantages([0.7, 0.7, 0.7]).tolist() == pytest.approx([0.0] * 3, abs=1e-10)
    assert group_advantages([0.5, 0.5]).tolist() == [0.0, 0.0]
    assert group_advantages([5.0]).tolist() == [0.0]
    assert group_advantages(torch.tensor([5.0])).tolist() == [0.0]


def test_advantages_are_float64_and_accept_tensors():
    adv = group_advantages(torch.tensor([1.0, 3.0], dtype=torch.float32))
    assert adv.dtype == torch.float64
    assert adv.tolist() == pytest.approx([-1 / (math.sqrt(2) + 1e-4), 1 / (math.sqrt(2) + 1e-4)])


@pytest.mark.parametrize("rewards", [[1.0, float("nan")], [float("inf"), 0.0], [-float("inf")]])
def test_non_finite_rewards_are_rejected(rewards):
    with pytest.raises(ValueError, match="rewards must be finite"):
        group_advantages(rewards)


@pytest.mark.parametrize("rewards", [[], [[1.0, 2.0]]])
def test_rewards_must_be_a_non_empty_1d_sequence(rewards):
    with pytest.raises(ValueError, match="non-empty 1-D"):
        group_advantages(rewards)


# --- aggregations ----------------------------------------------------------------------------------------------
LENGTHS = [3, 5, 2]


def test_token_mean_weights_every_token_of_the_group_equally():
    assert AGGREGATIONS["token-mean"].weights(LENGTHS, LossConfig()) == pytest.approx([0.1] * 3)


def test_seq_mean_weights_each_member_by_its_own_length():
    weights = AGGREGATIONS["seq-mean"].weights(LENGTHS, LossConfig())
    assert weights == pytest.approx([1 / 9, 1 / 15, 1 / 6])
    assert sum(w * n for w, n in zip(weights, LENGTHS, strict=True)) == pytest.approx(1.0)  # mean of member means


def test_dr_grpo_normalises_by_group_size_times_a_fixed_max_completion_length():
    """TRL's dr_grpo: Σ loss / (G · max_completion_length), L fixed (TRL 1.16's default 512), not the longest."""
    assert LossConfig().max_completion_length == 512
    assert AGGREGATIONS["dr-grpo"].weights(LENGTHS, LossConfig()) == pytest.approx([1 / (3 * 512)] * 3)
    config = LossConfig(aggregation="dr-grpo", max_completion_length=10)
    assert AGGREGATIONS["dr-grpo"].weights(LENGTHS, config) == pytest.approx([1 / 30] * 3)
    longest = LossConfig(aggregation="dr-grpo", max_completion_length=None)  # opt-in: each group's longest
    assert AGGREGATIONS["dr-grpo"].weights(LENGTHS, longest) == pytest.approx([1 / 15] * 3)


@pytest.mark.parametrize(
    ("loss_type", "aggregation"),
    [("dapo", "token-mean"), ("bnpo", "token-mean"), ("grpo", "seq-mean"), ("dr_grpo", "dr-grpo")],
)
def test_trl_loss_type_names_map_to_their_aggregation(loss_type, aggregation):
    config = LossConfig(aggregation=loss_type)
    assert config.aggregation == aggregation
    assert config.normalization == "batch"  # TRL normalises over the (micro-)batch, not per group
    assert LossConfig.model_validate_json(config.model_dump_json()) == config
    assert LossConfig(aggregation=loss_type, normalization="group").normalization == "group"  # given: kept


def test_this_projects_aggregation_names_normalise_per_group_by_default():
    assert LossConfig(aggregation="token-mean").normalization == LossConfig().normalization == "group"


def test_members_without_loss_tokens_get_zero_weight():
    assert AGGREGATIONS["seq-mean"].weights([0, 4], LossConfig()) == [0.0, 1 / 8]
    assert AGGREGATIONS["token-mean"].weights([0, 0], LossConfig()) == [0.0, 0.0]


def test_every_configurable_aggregation_is_implemented():
    names = set(LossConfig.model_fields["aggregation"].annotation.__args__)
    assert names == set(AGGREGATIONS) == {"token-mean", "seq-mean", "dr-grpo"}


# --- the clipped ratio objective ------------------------------------------------------------------------------------
def ratio_loss(ratio: float, advantage: float, **config) -> tuple[float, float]:
    """Per-token loss and its gradient d loss / d logp at a given ratio exp(logp - old)."""
    old = torch.tensor([0.0], dtype=torch.float64)
    logp = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss = per_token(logp, advantage, LossConfig(**config), old_logp=old)
    loss.sum().backward()
    return float(loss.detach()), float(logp.grad)


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_loss", "gradient_flows"),
    [
        (1.0, 2.0, -2.0, True),  # inside the range
        (1.1, 2.0, -2.2, True),
        (1.3, 2.0, -2.4, False),  # A > 0 above 1 + eps: clipped, no gradient
        (0.7, 2.0, -1.4, True),  # A > 0 below 1 - eps: the unclipped term is the min, gradient flows
        (0.7, -2.0, 1.6, False),  # A < 0 below 1 - eps: clipped, no gradient
        (1.3, -2.0, 2.6, True),  # A < 0 above 1 + eps: unclipped (pessimistic) term, gradient flows
    ],
)
def test_clipping_follows_the_pessimistic_bound(ratio, advantage, expected_loss, gradient_flows):
    loss, grad = ratio_loss(ratio, advantage, epsilon=0.2)
    assert loss == pytest.approx(expected_loss, rel=1e-12)
    if gradient_flows:
        assert grad == pytest.approx(-advantage * ratio, rel=1e-12)  # d(-r A)/d logp = -r A
    else:
        assert grad == 0.0


def test_clip_boundaries_and_asymmetric_upper_range():
    # at exactly 1 + eps both terms agree; just past it the upper clip (epsilon_high) holds the value
    assert ratio_loss(1.2, 1.0, epsilon=0.2)[0] == pytest.approx(-1.2)
    assert ratio_loss(1.25, 1.0, epsilon=0.2)[0] == pytest.approx(-1.2)
    assert ratio_loss(1.25, 1.0, epsilon=0.2, epsilon_high=0.28) == pytest.approx((-1.25, -1.25))
    assert ratio_loss(1.4, 1.0, epsilon=0.2, epsilon_high=0.28) == pytest.approx((-1.28, 0.0))
    assert ratio_loss(0.75, -1.0, epsilon=0.2, epsilon_high=0.28) == pytest.approx((0.8, 0.0))  # lower bound: eps
    assert LossConfig(epsilon=0.2).clip_high == 0.2 and LossConfig(epsilon=0.2, epsilon_high=0.3).clip_high == 0.3


def test_on_policy_ratio_is_one_with_the_policy_gradient():
    logp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    loss = per_token(logp, 1.5, LossConfig())
    assert loss.tolist() == [-1.5] * 3
    loss.sum().backward()
    assert logp.grad.tolist() == [-1.5] * 3


def test_unknown_behaviour_logprobs_fall_back_to_on_policy():
    logp = torch.tensor([-1.0, -2.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([float("nan"), -2.0 - math.log(1.1)], dtype=torch.float64)
    loss = per_token(logp, 1.0, LossConfig(), old_logp=old)
    assert loss.tolist() == pytest.approx([-1.0, -1.1])


def test_per_token_loss_broadcasts_advantages_per_member_row():
    logp = torch.zeros(2, 3, dtype=torch.float64)
    loss = per_token(logp, torch.tensor([[1.0], [-2.0]], dtype=torch.float64), LossConfig())
    assert loss.tolist() == [[-1.0] * 3, [2.0] * 3]


def test_each_importance_variant_is_one_loss_class_chosen_from_the_config():
    names = set(LossConfig.model_fields["importance"].annotation.__args__)
    assert names == set(LOSSES) == {"ratio", "tis", "icepop"}
    assert type(GRPOLoss.from_config(LossConfig())) is RatioLoss
    assert type(GRPOLoss.from_config(LossConfig(importance="tis"))) is TISLoss
    assert type(GRPOLoss.from_config(LossConfig(importance="icepop"))) is IcePopLoss


# --- truncated importance sampling (offline replay) ------------------------------------------------------------
def test_truncated_importance_weights_an_on_policy_ratio():
    """importance="tis": the ratio is taken against the current policy (so it is 1 and never clipped) and each
    token's loss is weighted by min(exp(l - l_behaviour), tis_cap), a constant."""
    config = LossConfig(importance="tis", tis_cap=2.0, epsilon=0.2)
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([-1.0, -1.5, -4.0, float("nan")], dtype=torch.float64)
    loss = per_token(logp, 2.0, config, old_logp=behaviour)
    weights = [1.0, math.exp(0.5), 2.0, 1.0]  # equal, above 1, capped, unknown behaviour: on-policy
    assert loss.tolist() == pytest.approx([-2.0 * w for w in weights], rel=1e-12)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-2.0 * w for w in weights], rel=1e-12)


def test_truncated_importance_without_behaviour_logprobs_is_plain_on_policy():
    logp = torch.tensor([-0.5, -2.0], dtype=torch.float64)
    assert per_token(logp, 1.0, LossConfig(importance="tis")).tolist() == [-1.0, -1.0]


def test_icepop_masks_the_tokens_whose_importance_weight_leaves_its_bounds():
    """importance="icepop": TIS's weight exp(l - l_behaviour) inside [icepop_low, icepop_high], 0 outside (no
    gradient at all from such a token, where TIS would truncate it to its cap)."""
    config = LossConfig(importance="icepop", icepop_low=0.5, icepop_high=2.0)
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0, -1.0], dtype=torch.float64, requires_grad=True)
    behaviour = torch.tensor([-1.0, -1.5, -4.0, 0.0, float("nan")], dtype=torch.float64)
    loss = per_token(logp, 2.0, config, old_logp=behaviour)
    weights = [1.0, math.exp(0.5), 0.0, 0.0, 1.0]  # equal, inside, far above (e^3), below (e^-1), unknown: on-policy
    assert loss.tolist() == pytest.approx([-2.0 * w for w in weights], rel=1e-12)
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([-2.0 * w for w in weights], rel=1e-12)
    with pytest.raises(pydantic.ValidationError, match="icepop_low"):
        LossConfig(importance="icepop", icepop_low=2.0, icepop_high=2.0)


# --- KL ---------------------------------------------------------------------------------------------------------
def test_k3_kl_term_and_its_gradient():
    logp = torch.tensor([-1.0, -2.0, -0.3], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -2.0, -0.1], dtype=torch.float64)
    beta = 0.3
    plain = LossConfig(beta=beta, use_bias_correction_kl=False)
    with_kl = per_token(logp, 0.0, plain, ref_logp=ref)  # A = 0: only the KL remains
    delta = ref - logp.detach()
    k3 = torch.exp(delta) - delta - 1
    assert with_kl.tolist() == pytest.approx((beta * k3).tolist(), rel=1e-14)
    assert with_kl[1] == 0.0 and (k3 >= 0).all()  # k3 is non-negative and zero where the policies agree
    with_kl.sum().backward()
    assert logp.grad.tolist() == pytest.approx((beta * (1 - torch.exp(delta))).tolist(), rel=1e-12)


def test_the_kl_bias_correction_adds_beta_k3_grad_logp_on_policy():
    """TRL 1.16's use_bias_correction_kl (the default): k3 times the differentiable ratio, 1 in value on-policy."""
    assert LossConfig().use_bias_correction_kl
    ref = torch.tensor([-1.5, -2.0, -0.1], dtype=torch.float64)
    logp = torch.tensor([-1.0, -2.0, -0.3], dtype=torch.float64, requires_grad=True)
    beta = 0.3
    corrected = per_token(logp, 0.0, LossConfig(beta=beta), ref_logp=ref)
    delta = ref - logp.detach()
    k3 = torch.exp(delta) - delta - 1
    assert corrected.tolist() == pytest.approx((beta * k3).tolist(), rel=1e-14)  # the ratio is 1 on-policy
    corrected.sum().backward()
    expected = beta * (1 - torch.exp(delta)) + beta * k3
    assert logp.grad.tolist() == pytest.approx(expected.tolist(), rel=1e-12)


@pytest.mark.parametrize("importance", ["ratio", "tis"])
def test_off_policy_the_kl_term_is_weighted_by_the_policy_terms_ratio(importance):
    """Off-policy the correction's ratio is the clipped term's: against the behaviour log-probs ("ratio"), or
    against the current policy ("tis", whose behaviour log-probs only weight the policy term)."""
    logp = torch.tensor([-1.0, -0.5], dtype=torch.float64)
    old = torch.tensor([-1.2, -0.2], dtype=torch.float64)
    ref = torch.tensor([-1.5, -0.1], dtype=torch.float64)
    loss = per_token(logp, 0.0, LossConfig(beta=1.0, importance=importance), old_logp=old, ref_logp=ref)
    ratio = torch.exp(logp - old) if importance == "ratio" else torch.ones(2, dtype=torch.float64)
    assert loss.tolist() == pytest.approx((k3_kl(logp, ref) * ratio).tolist(), rel=1e-14)


def test_the_kl_metric_is_the_detached_k3_of_the_loss_shape_and_absent_without_beta():
    logp = torch.tensor([[-1.0, -2.0], [-0.3, -0.5]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.5, -2.0], dtype=torch.float64)  # one reference row broadcast over the member rows
    loss, metrics = GRPOLoss.from_config(LossConfig(beta=0.3))(logp, torch.ones(2, 1, dtype=torch.float64), None, ref)
    assert metrics.kl.shape == loss.shape == (2, 2) and not metrics.kl.requires_grad
    assert torch.equal(metrics.kl, k3_kl(logp.detach(), ref))
    _, without = GRPOLoss.from_config(LossConfig())(logp, 1.0, None, ref)
    assert without.kl is None


def test_kl_needs_reference_logprobs():
    with pytest.raises(ValueError, match="reference"):
        per_token(torch.zeros(2), 1.0, LossConfig(beta=0.1))


def test_beta_zero_ignores_reference_logprobs():
    logp = torch.zeros(2, dtype=torch.float64)
    assert per_token(logp, 1.0, LossConfig(), ref_logp=torch.full((2,), -3.0)).tolist() == [-1.0, -1.0]


# --- helpers ----------------------------------------------------------------------------------------------------
def test_token_logprobs_are_log_softmax_at_the_targets_in_at_least_fp32():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]], dtype=torch.bfloat16)
    out = token_logprobs(logits, torch.tensor([2, 1]))
    assert out.dtype == torch.float32
    expected = torch.log_softmax(logits.float(), -1)[[0, 1], [2, 1]]
    assert torch.equal(out, expected)
    assert token_logprobs(logits.double(), torch.tensor([0, 0])).dtype == torch.float64


def test_token_logprobs_use_the_sampling_temperature():
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)
    out = token_logprobs(logits, torch.tensor([2]), temperature=0.5)
    assert float(out) == pytest.approx(float(torch.log_softmax(logits * 2, -1)[0, 2]), rel=1e-14)
    assert torch.equal(token_logprobs(logits, torch.tensor([2]), temperature=1.0), torch.log_softmax(logits, -1)[:, 2])


def test_clip_fraction_counts_tokens_outside_the_range():
    logp = torch.log(torch.tensor([1.0, 1.3, 0.7, 1.19], dtype=torch.float64))
    assert float(clip_fraction(logp, torch.zeros(4, dtype=torch.float64), LossConfig(epsilon=0.2))) == 0.5


# --- config -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"epsilon": -0.1}, "epsilon"),
        ({"epsilon_high": -1.0}, "epsilon_high"),
        ({"beta": -0.01}, "beta"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"max_completion_length": 0}, "max_completion_length"),
        ({"temperature": 0.0}, "temperature"),
        ({"importance": "is"}, "importance"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"normalization": "all"}, "normalization"),
        ({"epsilon_low": 0.2}, "epsilon_low"),  # unknown names are errors, not silently ignored
    ],
)
def test_loss_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(pydantic.ValidationError) as info:
        LossConfig(**kwargs)
    assert info.value.errors()[0]["loc"] == (field,)


def test_loss_config_defaults_match_trl_and_are_frozen():
    config = LossConfig()
    defaults = (config.epsilon, config.epsilon_high, config.beta, config.aggregation, config.scale_rewards)
    assert defaults == (0.2, None, 0.0, "token-mean", True)
    assert (config.max_completion_length, config.use_bias_correction_kl) == (512, True)  # TRL 1.16
    assert config.normalization == "group"
    with pytest.raises(pydantic.ValidationError):
        config.beta = 1.0
