"""The GRPO objective (defaults match TRL 1.16's GRPOTrainer), written per token so that any execution mode and any
prefix tree can evaluate it piece by piece.

For member i of a group with reward r_i, advantage ``A_i = (r_i - mean r) / (std r + 1e-4)`` (unbiased std, as
``torch.std``; ``scale_rewards=False`` drops the division, as Dr. GRPO). For each loss token t of member i, with
current log-prob ``l``, behaviour log-prob ``l_old`` (``l.detach()`` on-policy) and reference log-prob ``l_ref``:

    ratio = exp(l - l_old)
    per_token = -min(ratio * A_i, clip(ratio, 1 - eps_low, 1 + eps_high) * A_i) + beta * ratio * k3(l_ref - l)
    k3(d) = exp(d) - d - 1

The ``ratio`` factor of the KL term is TRL 1.16's ``use_bias_correction_kl`` (its default, and ours): it is 1 in
value on-policy but differentiable, so each token's KL gradient gains ``beta * k3 * grad l`` (the importance weight
that makes the k3 estimate unbiased for samples of the behaviour policy); ``use_bias_correction_kl=False`` gives
plain k3, as TRL before 1.16.

Off-policy data (offline replay, asynchronous GRPO) can instead use truncated importance sampling
(``importance="tis"``, as verl's TIS): the ratio is taken w.r.t. the current policy (``l_old = l.detach()``) and each
token's loss is weighted by ``min(exp(l.detach() - l_behaviour), tis_cap)``; or IcePop's masking
(``importance="icepop"``, Ring-1T): the same weight where it lies within ``[icepop_low, icepop_high]`` and 0 outside,
so a token the two policies disagree on too much contributes nothing instead of a truncated share. Log-probs are of
``softmax(logits / temperature)``, the distribution the sampler drew from.

The group's loss is ``Σ_i c_i Σ_t per_token``, where the aggregation sets the member weight ``c_i``:
token-mean ``1 / Σ_j n_j`` (default), seq-mean ``1 / (G n_i)``, dr-grpo ``1 / (G L)`` with L a fixed
``max_completion_length`` (TRL 1.16's GRPOConfig default, 512; set it to the sampling budget, e.g. max_new_tokens x
max_turns for agents). ``normalization`` says over which members the aggregation runs: ``"group"`` (each group on
its own, and a step averages its groups) or ``"batch"`` (all members of all groups of the step as one pool, so
token-mean divides by the loss tokens of the whole batch, as TRL's "dapo"). TRL's ``loss_type`` names are accepted
and mean TRL's semantics, batch normalisation included: "dapo" and "bnpo" (Σ loss / Σ tokens) are token-mean, "grpo"
(mean over sequences of each sequence's token mean) is seq-mean, "dr_grpo" is dr-grpo. (TRL's bnpo, grpo and
dr_grpo normalise over one process's micro-batch, its dapo over the whole batch: with one process and one
micro-batch per step they are this project's batch normalisation.)

``GRPOLoss.from_config(config)`` picks the per-token objective once (``RatioLoss`` or ``TISLoss``); ``k3_kl`` and
``GRPOLoss.kl_term`` are the one place the KL term is computed.

Because the loss is linear in per-member terms, a token shared by several members (a shared loss node of the segment
tree) carries the sum of their terms and the total equals the naive per-member loss exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from torch import Tensor

from longstraw_agents.trainer.metrics import TokenMetrics

AggregationName = Literal["token-mean", "seq-mean", "dr-grpo"]
NormalizationName = Literal["group", "batch"]
ADVANTAGE_EPS = 1e-4  # TRL's epsilon in (r - mean) / (std + eps)
TRL_MAX_COMPLETION_LENGTH = 512  # TRL 1.16 GRPOConfig.max_completion_length default: dr-grpo's fixed normaliser
# TRL's loss_type -> our aggregation; a TRL name also means TRL's batch normalisation (LossConfig._trl_semantics)
TRL_LOSS_TYPES: dict[str, str] = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean", "dr_grpo": "dr-grpo"}


class LossConfig(BaseModel):
    """Hyper-parameters of the GRPO objective."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    epsilon: float = Field(0.2, ge=0.0, description="lower clip range: ratio >= 1 - epsilon")
    epsilon_high: float | None = Field(None, ge=0.0, description="upper clip range (default: epsilon)")
    beta: float = Field(0.0, ge=0.0, description="weight of the k3 KL penalty to the reference model")
    aggregation: AggregationName = Field(
        "token-mean",
        description="how per-token losses become the group loss; TRL's dapo/bnpo/grpo/dr_grpo are accepted too",
    )
    scale_rewards: bool = Field(True, description="divide advantages by the group's reward std")
    normalization: NormalizationName = Field(
        "group",
        description="group: the aggregation within each group, groups averaged; batch: over all members of the "
        "step's groups as one pool (TRL's dapo: Σ loss / loss tokens of the whole batch). TRL loss_type names set it "
        "to batch unless given",
    )
    max_completion_length: int | None = Field(
        TRL_MAX_COMPLETION_LENGTH,
        ge=1,
        description="dr-grpo's fixed normaliser L, as TRL 1.16 (default 512); None: the longest completion among "
        "the members normalised together",
    )
    use_bias_correction_kl: bool = Field(
        True,
        description="multiply the k3 term by the differentiable ratio (TRL 1.16's default): adds beta·k3·∇logp",
    )
    temperature: float = Field(1.0, gt=0.0, description="log-probs of softmax(logits / temperature), as sampled")
    importance: Literal["ratio", "tis", "icepop"] = Field(
        "ratio",
        description="ratio: behaviour logprobs as l_old; tis: truncated importance weights; icepop: importance "
        "weights masked to 0 outside [icepop_low, icepop_high] (off-policy data: offline replay, max_staleness)",
    )
    tis_cap: float = Field(2.0, gt=0.0, description="cap of the truncated importance weight (importance='tis')")
    icepop_low: float = Field(0.5, gt=0.0, description="importance='icepop': smallest weight kept (IcePop's alpha)")
    icepop_high: float = Field(5.0, gt=0.0, description="importance='icepop': largest weight kept (IcePop's beta)")

    @model_validator(mode="before")
    @classmethod
    def _trl_semantics(cls, data: object) -> object:
        """A TRL loss_type name also means TRL's normalisation over the batch, unless ``normalization`` is given."""
        if isinstance(data, dict) and data.get("aggregation") in TRL_LOSS_TYPES and "normalization" not in data:
            return {**data, "normalization": "batch"}
        return data

    @model_validator(mode="after")
    def _icepop_bounds_in_order(self) -> LossConfig:
        if self.icepop_low >= self.icepop_high:
            raise ValueError(f"icepop_low ({self.icepop_low:g}) must be below icepop_high ({self.icepop_high:g})")
        return self

    @field_validator("aggregation", mode="before")
    @classmethod
    def _trl_loss_type(cls, value: object) -> object:
        return TRL_LOSS_TYPES.get(value, value) if isinstance(value, str) else value

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def group_advantages(rewards: Sequence[float] | Tensor, scale: bool = True) -> Tensor:
    """``(r - mean) / (std + 1e-4)`` with the unbiased std; a single-member group has zero advantage."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim != 1 or r.numel() == 0:
        raise ValueError(f"rewards must be a non-empty 1-D sequence, got shape {tuple(r.shape)}")
    if not torch.isfinite(r).all():
        raise ValueError(f"rewards must be finite, got {r.tolist()}")
    centred = r - r.mean()
    if not scale:
        return centred
    std = r.std() if r.numel() > 1 else torch.zeros((), dtype=r.dtype)
    return centred / (std + ADVANTAGE_EPS)


class Aggregation(ABC):
    """Turns per-member token counts into per-member weights ``c_i`` of ``Σ_i c_i Σ_t loss_it``."""

    name: ClassVar[str]

    @abstractmethod
    def weights(self, lengths: Sequence[int], config: LossConfig) -> list[float]: ...


class TokenMean(Aggregation):
    name = "token-mean"

    def weights(self, lengths: Sequence[int], config: LossConfig) -> list[float]:
        total = sum(lengths)
        return [1.0 / total if total else 0.0 for _ in lengths]


class SeqMean(Aggregation):
    name = "seq-mean"

    def weights(self, lengths: Sequence[int], config: LossConfig) -> list[float]:
        return [1.0 / (len(lengths) * n) if n else 0.0 for n in lengths]


class DrGRPO(Aggregation):
    name = "dr-grpo"

    def weights(self, lengths: Sequence[int], config: LossConfig) -> list[float]:
        # a constant L (TRL) keeps the per-token weight independent of how long this group's completions are
        norm = config.max_completion_length or max(lengths)
        return [1.0 / (len(lengths) * norm) if norm else 0.0 for _ in lengths]


AGGREGATIONS: dict[str, Aggregation] = {a.name: a for a in (TokenMean(), SeqMean(), DrGRPO())}


@dataclass(frozen=True)
class MemberTerms:
    """What one member contributes per loss token: its advantage and aggregation weight."""

    advantage: float
    weight: float


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[target] per row, in at least fp32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """The k3 estimator of KL(policy || reference) per token: ``exp(d) - d - 1`` with ``d = l_ref - l`` (>= 0, zero
    where the two agree; differentiable in ``logp``)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


class GRPOLoss(ABC):
    """The per-token GRPO objective; one subclass per ``LossConfig.importance``, chosen once by ``from_config``.

    ``loss(logp, advantage, old_logp, ref_logp) -> (per_token_loss, metrics)``. Shapes: ``logp`` is ``[..., T]``
    (current log-probs of T tokens, e.g. ``[T]`` for one member or ``[M, T]`` for M members sharing a node);
    ``advantage`` a float or a tensor broadcasting against it (``[M, 1]``: one per member row); ``old_logp``
    (behaviour log-probs, NaN where unknown: treated as on-policy) and ``ref_logp`` (reference log-probs, needed
    when beta > 0 and ignored otherwise) broadcast against ``logp``. ``per_token_loss`` has ``logp``'s shape and is
    unreduced (no mask, no member weight); ``metrics.kl`` is the detached k3 KL of that shape, without the bias
    correction's ratio (None when beta = 0).
    """

    importance: ClassVar[str]

    def __init__(self, config: LossConfig):
        self.config = config

    @staticmethod
    def from_config(config: LossConfig) -> GRPOLoss:
        return LOSSES[config.importance](config)

    def __call__(
        self,
        logp: Tensor,
        advantage: float | Tensor,
        old_logp: Tensor | None = None,
        ref_logp: Tensor | None = None,
    ) -> tuple[Tensor, TokenMetrics]:
        current = logp.detach()
        behaviour = None if old_logp is None else torch.where(torch.isnan(old_logp), current, old_logp)
        loss = self.policy_loss(logp, advantage, behaviour)
        if self.config.beta == 0.0:
            return loss, TokenMetrics()
        if ref_logp is None:
            raise ValueError("beta > 0 needs reference log-probs (pass a ref_model)")
        kl = k3_kl(logp, ref_logp)
        return loss + self.config.beta * self.kl_term(kl, logp, behaviour), TokenMetrics(kl=kl.detach())

    def kl_term(self, kl: Tensor, logp: Tensor, behaviour: Tensor | None) -> Tensor:
        """The KL penalty per token (before beta): k3, times the policy term's ratio when ``use_bias_correction_kl``
        (TRL 1.16: 1 in value on-policy, its gradient adds ``k3 * grad logp``)."""
        if not self.config.use_bias_correction_kl:
            return kl
        return kl * torch.exp(self.log_ratio(logp, behaviour))

    @abstractmethod
    def log_ratio(self, logp: Tensor, behaviour: Tensor | None) -> Tensor:
        """The log of the clipped ratio (differentiable in ``logp``); ``behaviour``: known behaviour log-probs
        (None: on-policy)."""

    @abstractmethod
    def policy_loss(self, logp: Tensor, advantage: float | Tensor, behaviour: Tensor | None) -> Tensor:
        """The policy-gradient term per token; ``behaviour``: known behaviour log-probs (None: on-policy)."""

    def clipped(self, log_ratio: Tensor, advantage: float | Tensor) -> Tensor:
        """``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with ``r = exp(log_ratio)``."""
        ratio = torch.exp(log_ratio)
        clipped = torch.clamp(ratio, 1.0 - self.config.epsilon, 1.0 + self.config.clip_high)
        return -torch.minimum(ratio * advantage, clipped * advantage)


class RatioLoss(GRPOLoss):
    """``importance="ratio"``: the clipped ratio against the behaviour log-probs (``l.detach()`` on-policy)."""

    importance = "ratio"

    def log_ratio(self, logp: Tensor, behaviour: Tensor | None) -> Tensor:
        return logp - (logp.detach() if behaviour is None else behaviour)

    def policy_loss(self, logp: Tensor, advantage: float | Tensor, behaviour: Tensor | None) -> Tensor:
        return self.clipped(self.log_ratio(logp, behaviour), advantage)


class TISLoss(GRPOLoss):
    """``importance="tis"`` (verl's truncated importance sampling, for offline replay): the ratio is taken against
    the current policy and each token is weighted by the constant ``min(exp(l - l_behaviour), tis_cap)``."""

    importance = "tis"

    def log_ratio(self, logp: Tensor, behaviour: Tensor | None) -> Tensor:
        return logp - logp.detach()  # against the current policy: behaviour enters as the TIS weight only

    def policy_loss(self, logp: Tensor, advantage: float | Tensor, behaviour: Tensor | None) -> Tensor:
        current = logp.detach()
        loss = self.clipped(self.log_ratio(logp, behaviour), advantage)
        if behaviour is None:
            return loss
        return loss * torch.clamp(torch.exp(current - behaviour), max=self.config.tis_cap)


class IcePopLoss(TISLoss):
    """``importance="icepop"`` (IcePop, from Ring-1T): TIS's weight ``exp(l - l_behaviour)`` where it lies within
    ``[icepop_low, icepop_high]``, and 0 outside (the token is masked, not truncated): a token whose behaviour
    probability the current policy no longer agrees with carries no gradient."""

    importance = "icepop"

    def policy_loss(self, logp: Tensor, advantage: float | Tensor, behaviour: Tensor | None) -> Tensor:
        loss = self.clipped(self.log_ratio(logp, behaviour), advantage)
        if behaviour is None:
            return loss
        weight = torch.exp(logp.detach() - behaviour)
        kept = (weight >= self.config.icepop_low) & (weight <= self.config.icepop_high)
        return loss * torch.where(kept, weight, torch.zeros_like(weight))


LOSSES: dict[str, type[GRPOLoss]] = {cls.importance: cls for cls in (RatioLoss, TISLoss, IcePopLoss)}


def clip_fraction(logp: Tensor, old_logp: Tensor, config: LossConfig) -> Tensor:
    ratio = torch.exp(logp.detach() - old_logp)
    return ((ratio < 1.0 - config.epsilon) | (ratio > 1.0 + config.clip_high)).double().mean()
