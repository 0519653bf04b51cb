"""The time model: how long a GRPO step takes, from the work its schedule does and a hardware profile
(``longstraw plan --time``).

The work of each phase is counted for one rank from the model's config and the schedule the engine runs, by class:

- ``matmul``: FLOPs of the weight matmuls — two per weight a token multiplies (a mixture of experts' routed share
  only: ``FamilyAdapter.active_fraction``), the LM head where log-probs are taken;
- ``attention`` (and ``attention_backward``): softmax attention's (query, key) pairs as the fused kernels compute
  them (the masked half of a chunk's diagonal block skipped; DSA's top-k rows: ``FamilyAdapter.layer_work``);
- ``recurrent`` (and ``recurrent_backward``): GatedDeltaNet's chunked delta rule;
- ``selection``: DSA's index scores, each with its share of the top-k (no gradient);
- ``elementwise``: the elements the matmuls write, which the norms, rotations, activations, residuals and merges
  around them go over;
- ``gathered``: bytes gathered row by row (DSA's selected rows), scattered back in backward;
- ``memory``: bytes a memory-bound phase reads (decoding: the weights once per step for the whole batch, the shared
  prefix's state once per step per group, each member's own rows);
- ``launches``, ``branch_calls``, ``decode_calls``: layer calls (and sequential steps inside a layer) of a chunk, of
  a branch (an extend under autograd's bookkeeping) and of a batched decoding step — each a few dozen kernels whose
  host-side cost no FLOP count shows, different on each path;
- ``comm``: bytes the rank sends and receives: the capture's rows from earlier cp ranks, the partial attention
  merged over cp ranks in replicated extends, exact mode's state gradient going back, FSDP's gathers and
  reduce-scatters;
- ``host``: bytes between host and device where the shards are offloaded (each gather's shards in, each
  reduction's gradient shard out), and ``host_step``: the bytes AdamW's step goes over there (on the device its
  step is ``memory``): the ``optimizer`` phase, once per optimizer step.

A backward pass costs twice its forward in matmuls, the delta rule and elementwise work and 2.5 times in attention
(the fused backward recomputes the scores: five products to the forward's two); activation checkpointing adds one
forward. A LoRA policy (``PlanRequest.lora``) adds its adapters' matmuls, and a frozen weight's backward is one
product (its input's gradient), not two (``ModelWork.backward_products``); gradients are reduced and AdamW steps for
the adapters alone. (Autograd skips the input gradient of the first layer's input projections too, the embeddings
being frozen: not counted, a share of about 1 / (3 x layers) of a layer's matmuls.) Attention's and the delta rule's
backward are classes of their own, each at its own rate (their kernels are not their forwards').

``HardwareProfile`` turns work into seconds: each class at its own achieved rate (peak x efficiency) plus the host's
latency per layer call on each path, summed (no overlap: an upper estimate where communication hides behind
compute, or the host behind the device). ``bench/ceilings.py`` measures a profile op by op (a layer-shaped matmul,
the attention kernels, the delta rule, DSA's top-k, a matrix-vector product, layer calls at a negligible width) and
``bench/timing.py`` checks it against every phase measured on the same machine, none fitted; ``calibrate`` instead
fits a profile to measured phases. The H200's profile has its matmul and copy rates from measurements on one and
typical attention fractions; H100 and H20 take the same fractions at their own peaks — a model output, labelled
as such.

    time = step_time(PlanRequest(model="qwen3.6-27b", context=2_100_000, gpus=8), PROFILES["h20"])
    print(time.table())

The time model's modules: ``work`` (the classes of work, a model's work), ``phases`` (a step's phases on a rank:
``step_work``), ``hardware`` (profiles and calibration); here the step's time.
"""

from __future__ import annotations

from dataclasses import dataclass

from longstraw_agents.plan.hardware import HardwareProfile
from longstraw_agents.plan.phases import StepWork, step_work
from longstraw_agents.plan.request import PlanRequest
from longstraw_agents.plan.work import COMPUTE_CLASSES


@dataclass(frozen=True)
class StepTime:
    """A step's phases in seconds on ``profile`` (each the sum of its classes), the communication's share."""

    work: StepWork
    profile: HardwareProfile

    def phase_seconds(self) -> dict[str, float]:
        return {name: self.profile.time(work) for name, work in self.work.phases.items()}

    def training_seconds(self) -> float:
        """The step without rollouts (what a served policy leaves to the trainer's GPUs)."""
        return sum(s for name, s in self.phase_seconds().items() if name != "rollout")

    def comm_share(self, kind: str = "comm") -> float:
        """The step's (without rollouts) share of ``kind``: "comm" (the interconnect's collectives and messages),
        "host" (offload's copies between host and device) or "host_step" (AdamW's step in host memory)."""
        train = [w for name, w in self.work.phases.items() if name != "rollout"]
        spent = sum(self.profile.seconds(w)[kind] for w in train)
        return spent / max(self.training_seconds(), 1e-30)

    def table(self) -> str:
        request = self.work.request
        lines = [
            f"Time model ({self.profile.name}; efficiencies: {self.profile.measured_on}) — a model output, "
            "not a measurement",
            f"{'phase':<10} {'seconds':>10} {'compute':>9} {'comm':>9} {'host':>9} {'memory':>9} {'launches':>9}"
            "  TFLOP",
        ]
        for name, work in self.work.phases.items():
            spent = self.profile.seconds(work)
            compute = sum(spent[c] for c in COMPUTE_CLASSES)
            host = spent["host"] + spent["host_step"]  # offload's copies and the optimizer's step there
            lines.append(
                f"{name:<10} {sum(spent.values()):>10.2f} {compute:>9.2f} {spent['comm']:>9.2f} {host:>9.2f} "
                f"{spent['memory']:>9.2f} {spent['launches']:>9.2f}  {work.flops / 1e12:.1f}"
            )
        gpus = f"each of {request.gpus} GPUs" if request.gpus > 1 else "one GPU"
        lines.append(
            f"step (without rollouts): {self.training_seconds():.1f} s on {gpus}, "
            f"communication {100 * self.comm_share():.0f} % of it"
            + (f", host copies {100 * self.comm_share('host'):.0f} %" if request.offload else "")
            + (f", the host's AdamW step {100 * self.comm_share('host_step'):.0f} %" if request.offload else "")
            + " (not overlapped: an upper estimate)"
        )
        return "\n".join(lines)


def step_time(request: PlanRequest, profile: HardwareProfile, rollout: bool = True) -> StepTime:
    return StepTime(step_work(request, rollout=rollout), profile)
