"""Hardware profiles: an accelerator's peaks and the efficiencies measured on it (``HardwareProfile``), which turn
work into seconds class by class; the shipped ``PROFILES``, a profile measured by ``bench/gpu.py``
(``measured_profile``) and one fitted to measured phases (``calibrate``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from longstraw_agents.plan.work import Work

FLOP_CLASSES = ("matmul", "attention", "attention_backward", "recurrent", "recurrent_backward")


class Efficiency(BaseModel):
    """Achieved / peak rate of each class of work (measured: ``calibrate``)."""

    model_config = ConfigDict(frozen=True)

    matmul: float = Field(gt=0)
    attention: float = Field(gt=0)
    attention_backward: float = Field(gt=0)
    recurrent: float = Field(gt=0)
    memory: float = Field(gt=0)
    link: float = Field(gt=0)
    recurrent_backward: float | None = Field(default=None, gt=0)  # None: the forward's (``recurrent``)

    def of(self, name: str) -> float:
        """The efficiency of class ``name`` (the delta rule's backward at its forward's where not measured)."""
        if name == "recurrent_backward" and self.recurrent_backward is None:
            return self.recurrent
        return float(getattr(self, name))


class HardwareProfile(BaseModel):
    """One accelerator: its peaks (the vendor's figures) and the efficiencies measured on it."""

    model_config = ConfigDict(frozen=True)

    name: str
    peak_flops: float = Field(gt=0)  # dense bf16 FLOP/s
    memory_bandwidth: float = Field(gt=0)  # bytes/s
    link_bandwidth: float = Field(gt=0)  # bytes/s per GPU and direction (NVLink, or the host's for a CPU)
    # bytes/s per GPU and direction between host and device: PCIe Gen5 x16 (64 GB/s), as pinned copies reach it
    host_bandwidth: float = Field(default=55e9, gt=0)
    # bytes/s of host memory one GPU's process gets for an offloaded optimizer step (torch's AdamW, a tensor at a
    # time): this machine's 2 cores reach 7-10 GB/s (bench/ceilings.py's host_step_rate); a prior of about 30 for a
    # GPU node's ~14 cores per GPU, not measured
    host_step_bandwidth: float = Field(default=30e9, gt=0)
    launch_s: float = Field(ge=0)  # seconds per layer call or sequential step of a chunk (host-side)
    branch_call_s: float = Field(ge=0)  # ... of a branch's extend
    decode_call_s: float = Field(ge=0)  # ... of a batched decoding step
    selection_s: float = Field(ge=0)  # seconds per (query, key) index score (DSA: scoring and its top-k)
    elementwise_s: float = Field(default=0.0, ge=0)  # seconds per matmul output element, for the kernels around it
    gather_s: float = Field(default=0.0, ge=0)  # seconds per byte gathered row by row (and scattered back)
    efficiency: Efficiency
    measured_on: str  # where the efficiencies come from

    def peaks(self) -> dict[str, float]:
        """The peak rate of each class whose achieved rate is an ``efficiency`` of it."""
        flops = dict.fromkeys(FLOP_CLASSES, self.peak_flops)
        return {**flops, "memory": self.memory_bandwidth}

    def rates(self) -> dict[str, float]:
        """Units of each class per second."""
        rates = {name: peak * self.efficiency.of(name) for name, peak in self.peaks().items()}
        links = {"comm": self.link_bandwidth * self.efficiency.link, "host": self.host_bandwidth}
        return {**rates, **links, "host_step": self.host_step_bandwidth}

    def seconds(self, work: Work) -> dict[str, float]:
        """Seconds of each class of ``work`` (their sum is the phase's time)."""
        rates = self.rates()
        spent = {name: getattr(work, name) / rate for name, rate in rates.items()}
        spent["selection"] = work.selection * self.selection_s
        spent["elementwise"] = work.elementwise * self.elementwise_s
        spent["gathered"] = work.gathered * self.gather_s
        spent["launches"] = work.launches * self.launch_s + work.branch_calls * self.branch_call_s
        spent["launches"] += work.decode_calls * self.decode_call_s
        return spent

    def time(self, work: Work) -> float:
        return sum(self.seconds(work).values())


def calibrate(
    profile: HardwareProfile,
    samples: Sequence[tuple[Work, float]],
    name: str | None = None,
    keep: Sequence[str] = (),
) -> HardwareProfile:
    """``profile`` with the rates that best predict ``samples`` (work, measured seconds): non-negative least squares
    on relative error, each class pulled weakly towards ``profile``'s own rate, so that a class the samples barely
    exercise keeps it; the classes in ``keep`` (measured directly: a large matmul, a copy) are not fitted.
    (Communication is not fitted either: one process sends nothing.)"""
    prior = _unit_seconds(profile)
    used = [c for c in FITTED if c not in keep and any(getattr(w, c) for w, _ in samples)]
    kept = [c for c in FITTED if c not in used]
    # unknowns: each class's seconds per unit as a multiple of the prior's (well scaled whatever the units); the
    # kept classes' seconds are taken off each sample first
    rows, targets = [], []
    for work, seconds in samples:
        rest = seconds - sum(getattr(work, c) * prior[c] for c in kept)
        rows.append([getattr(work, c) * prior[c] / seconds for c in used])
        targets.append(max(rest, 0.0) / seconds)
    pull = 1e-4  # the prior's weight against one sample's relative error: it decides only what the samples leave open
    for k in range(len(used)):
        rows.append([pull if j == k else 0.0 for j in range(len(used))])
        targets.append(pull)
    ratios = _nonnegative_least_squares(np.array(rows), np.array(targets))
    peaks = profile.peaks()
    unit = dict(prior)
    for c, ratio in zip(used, ratios, strict=True):
        # no class beats its peak (a class the samples leave at 0 runs at its peak), none is free
        unit[c] = max(prior[c] * float(ratio), 1.0 / peaks[c] if c in peaks else prior[c] * 1e-3)
    efficiency = profile.efficiency.model_copy(update={c: 1.0 / (unit[c] * peaks[c]) for c in peaks})
    update = {
        "launch_s": unit["launches"],
        "branch_call_s": unit["branch_calls"],
        "decode_call_s": unit["decode_calls"],
        "selection_s": unit["selection"],
        "elementwise_s": unit["elementwise"],
        "gather_s": unit["gathered"],
        "measured_on": name or profile.measured_on,
    }
    return profile.model_copy(update={"efficiency": efficiency, **update})


FITTED = (
    *("matmul", "attention", "attention_backward", "recurrent", "recurrent_backward", "selection", "elementwise"),
    *("memory", "gathered"),
    *("launches", "branch_calls", "decode_calls"),
)


def _nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0 (an active set: the most negative unknown is held at 0 until none is)."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        solution, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (solution >= 0).all():
            x[free] = solution
            break
        free.pop(int(np.argmin(solution)))
    return x


def _unit_seconds(profile: HardwareProfile) -> dict[str, float]:
    """Seconds per unit of each fitted class."""
    rates = profile.rates()
    unit = {c: 1.0 / rates[c] for c in profile.peaks()}
    unit["launches"] = max(profile.launch_s, 1e-9)
    unit["branch_calls"] = max(profile.branch_call_s, 1e-9)
    unit["decode_calls"] = max(profile.decode_call_s, 1e-9)
    unit["selection"] = max(profile.selection_s, 1e-15)
    unit["elementwise"] = max(profile.elementwise_s, 1e-15)
    unit["gathered"] = max(profile.gather_s, 1e-15)
    return unit


NVLINK_BYTES_PER_S = 450e9  # NVLink 4: 900 GB/s per GPU, both directions together
# An H200: matmul and memory at what a large bf16 matmul (788 TFLOP/s) and a device copy (4.3 TB/s) reached on one
# here; attention at 0.35 of peak (FlashAttention-2's forward on Hopper; the dense capture's growth from 32K to 128K
# on one here, where attention dominates, gives 0.32), its backward 0.25; the host latencies are not measured on it
# (they matter for small models only: bench/timing.py). bench/ceilings.py measures all of them on a GPU run.
H200_PRIOR = HardwareProfile(
    name="H200",
    peak_flops=989e12,
    memory_bandwidth=4.8e12,
    link_bandwidth=NVLINK_BYTES_PER_S,
    launch_s=30e-6,
    branch_call_s=100e-6,
    decode_call_s=100e-6,
    selection_s=1e-12,
    elementwise_s=3e-12,  # about six bf16 passes over each element at the copy's rate
    gather_s=1e-12,  # rows of a kilobyte or more gather near the copy's rate
    efficiency=Efficiency(matmul=0.8, attention=0.35, attention_backward=0.25, recurrent=0.2, memory=0.9, link=0.7),
    measured_on="matmul and copy rates measured on an H200, attention and host latencies typical, not measured",
)


def hopper(name: str, peak_flops: float, memory_bandwidth: float, measured: HardwareProfile) -> HardwareProfile:
    """A Hopper GPU at its own peaks with ``measured``'s efficiencies and host latencies (an H200's)."""
    return measured.model_copy(update={"name": name, "peak_flops": peak_flops, "memory_bandwidth": memory_bandwidth})


PROFILES: dict[str, HardwareProfile] = {
    "h200": H200_PRIOR,
    "h100": hopper("H100 SXM", 989e12, 3.35e12, H200_PRIOR),
    "h20": hopper("H20", 148e12, 4.0e12, H200_PRIOR),
}


def measured_profile(record: dict, family: str, links: HardwareProfile) -> HardwareProfile:
    """The profile ``bench/gpu.py`` measured for ``family`` on one GPU (its record's ``setup[family]["profile"]``;
    ``bench/timing.py``'s output, ``profiles[family]``, and a bare profile are read too), with the interconnect and
    host links of ``links`` (one process measures neither): every compute, memory and per-call rate from the run's
    micro-benchmarks, none from typical fractions."""
    if "setup" in record:
        measured = (record["setup"].get(family) or {}).get("profile")
        found = sorted(f for f, s in record["setup"].items() if s and s.get("profile"))
    elif "profiles" in record:
        measured, found = record["profiles"].get(family), sorted(record["profiles"])
    else:
        measured, found = record, []
    if measured is None:
        raise ValueError(
            f"the record has no profile measured for the {family} family (it has: {', '.join(found) or 'none'})"
        )
    profile = HardwareProfile(**measured)
    efficiency = profile.efficiency.model_copy(update={"link": links.efficiency.link})
    return profile.model_copy(
        update={
            "link_bandwidth": links.link_bandwidth,
            "host_bandwidth": links.host_bandwidth,
            "efficiency": efficiency,
            "measured_on": f"{profile.measured_on}; links: {links.name}'s",
        }
    )
