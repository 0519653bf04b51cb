"""How a job spreads over its processes: the run config's ``parallel:`` section (``ParallelSpec``) and the rules a
layout must keep (``layout_problem``).

Torch-free, so that ``longstraw plan`` checks its layout flags with the very rules ``longstraw train`` applies to a
run config, before it imports torch and transformers (seconds of CPU): one place for each rule.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

HSDP_WITHOUT_CP = (
    "hsdp shards over each dp rank's cp ranks: with cp = 1 it shards nothing, every GPU holding the whole model, its "
    "gradient and optimizer state (plain data parallelism); shard over every rank instead (fsdp without hsdp)"
)
HSDP_WITHOUT_DP = (
    "hsdp replicates over the dp ranks: with dp = 1 there is nothing to replicate over, and it would shard over "
    "the cp ranks exactly as fsdp without hsdp does; drop hsdp"
)


def layout_problem(
    dp: int, cp: int, fsdp: bool, hsdp: bool, offload: bool, expert_parallel: bool, expert_dispatch: bool
) -> str | None:
    """What keeps a layout of ``dp x cp`` processes from running, in one line naming the settings (as
    ``ParallelSpec`` and ``longstraw plan``'s flags call them), or None. FSDP2 shards only over 2 or more processes:
    on one, ``fsdp`` leaves the model whole."""
    sharded = fsdp and dp * cp > 1
    if hsdp and not fsdp:
        return "hsdp shards the model over each dp rank's cp ranks: it needs fsdp"
    if hsdp and cp == 1:
        return HSDP_WITHOUT_CP
    if hsdp and dp == 1:
        return HSDP_WITHOUT_DP
    if offload and not sharded:
        return "offload runs through FSDP2 (fsdp), which shards over 2 or more GPUs (dp x cp)"
    if expert_dispatch and not expert_parallel:
        return "expert_dispatch sends tokens to their experts' ranks: it needs expert_parallel"
    if expert_parallel and cp == 1:
        return "expert_parallel cuts the experts over the cp ranks: it needs cp > 1"
    if expert_parallel and not fsdp:
        return "expert_parallel holds each cp rank's experts in its FSDP2 shards: it needs fsdp"
    if expert_parallel and dp > 1 and not hsdp:
        return (
            "expert_parallel at dp > 1 needs hsdp (each dp rank's groups differ in shape, so its MoE calls cannot "
            "meet the other dp ranks')"
        )
    return None


class ParallelSpec(BaseModel):
    """How the run spreads over the processes of ``torchrun`` / ``accelerate launch`` (``dp * cp`` must equal
    their number, ``WORLD_SIZE``; checked when the run starts)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dp: int = Field(1, ge=1, description="data-parallel ranks: each rolls out and trains on its share of the groups")
    cp: int = Field(1, ge=1, description="context-parallel ranks per dp rank: they shard one prompt's state")
    fsdp: bool = Field(
        False,
        description="shard parameters, gradients and optimizer state over every rank, dp x cp (FSDP2); without it "
        "every process holds the whole model, its gradients and AdamW's state (`longstraw plan --config` plans "
        "either, as the run does)",
    )
    hsdp: bool = Field(
        False,
        description="with fsdp: shard over each dp rank's cp ranks and replicate over dp (FSDP2's hybrid sharding). "
        "Each GPU holds 1/cp of the model, gradients and optimizer state instead of 1/(dp x cp), and in exchange a "
        "gather spans a dp rank's cp ranks only (without it each dp rank gathers a layer at a time on a communicator "
        "of its own over every rank, which the other dp ranks serve: parallel.lanes); see `longstraw plan --hsdp`",
    )
    offload: bool = Field(
        False,
        description="with fsdp: FSDP2's CPU offload — the master shards, their gradients and AdamW's state live on "
        "the host and AdamW steps there; each layer's gradient shard is copied to the host as its reduction "
        "completes, and a gather copies the shards to the GPU first (see `longstraw plan --offload`)",
    )
    expert_parallel: bool = Field(
        False,
        description="with fsdp and cp > 1 (dp = 1, or hsdp): each cp rank holds whole experts of every MoE layer "
        "(glm_moe_dsa; the expert count a multiple of cp), computes them and never gathers the others'; every "
        "extend is then computed replicated (each rank's experts' share of each token, added over the ranks: "
        "engine.sharded_extends false unless expert_dispatch), and exact mode walks replicated (parallel.experts)",
    )
    expert_dispatch: bool = Field(
        False,
        description="with expert_parallel: compute long extends (the prompt's capture) sharded, each rank its own "
        "chunks, every MoE call a round of all-to-alls that sends each token to the ranks holding its experts and "
        "brings their outputs back (exact mode still walks replicated; `longstraw plan --expert-dispatch`); see "
        "docs/distributed.md",
    )
    host_staged_messages: bool = Field(
        False,
        description="cp > 1 on GPUs: stage the point-to-point messages of a sharded capture and of exact mode's "
        "wavefront walk through host memory and send them "
        "over gloo (matched by tag), instead of device to device over NCCL (matched in posting order, which the "
        "schedule keeps: parallel.discipline checks it on CPU). On CPUs both are the same messages",
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="seconds the processes of every node wait for each other to join, and a process may go without "
        "a heartbeat before the others take it for dead (its node lost or unreachable) and stop with a RankFailure "
        "naming it; a slow process that still beats is waited for (parallel.collective_timeout_s)",
    )
    heartbeat_s: float | None = Field(
        None,
        gt=0,
        description="seconds between a process's heartbeats: a thread beside training adds one to its counter in the "
        "job's store and reads the other processes' (at most half of timeout_s; default a quarter of it, at most 5)",
    )
    collective_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="seconds a collective waits while every process sends its heartbeat: longer than a healthy run's "
        "longest gap between collectives (a rollout's slow tool calls, a checkpoint); only a rank that hangs without "
        "dying reaches it (torch's own default on gloo)",
    )
    across_nodes: Literal["dp", "cp"] = Field(
        "dp",
        description="on several nodes, the mesh dimension that spans them; the other's groups stay inside a node. dp "
        "(default): a dp rank's cp ranks share a node, whose links carry their every-layer messages",
    )

    @property
    def heartbeat_every_s(self) -> float:
        """``heartbeat_s``, or its default."""
        return self.heartbeat_s if self.heartbeat_s is not None else min(self.timeout_s / 4, 5.0)

    @model_validator(mode="after")
    def _a_layout_that_runs(self) -> ParallelSpec:
        problem = layout_problem(
            self.dp, self.cp, self.fsdp, self.hsdp, self.offload, self.expert_parallel, self.expert_dispatch
        )
        if problem is not None:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _two_heartbeats_within_the_timeout(self) -> ParallelSpec:
        if self.heartbeat_s is not None and 2 * self.heartbeat_s > self.timeout_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s:g}) must be at most half of timeout_s ({self.timeout_s:g}): a process "
                "is taken for dead after timeout_s without a heartbeat, so one late beat must not be enough"
            )
        return self
