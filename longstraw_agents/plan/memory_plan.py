"""``Plan``: a step's bytes per GPU by category, the allocator margin (5 % plus 1 GiB: CUDA context, kernels'
workspaces, fragmentation), the rollouts' phase and the host's share, and the table ``longstraw plan`` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from longstraw_agents.engine import EngineConfig
from longstraw_agents.plan.request import PlanRequest

GIB = 2**30
MARGIN_FRACTION = 0.05
MARGIN_FIXED = GIB
CATEGORY_WIDTH = 38  # the table's category column


@dataclass
class Plan:
    """Bytes per GPU by category, the allocator margin, and how the figures were obtained."""

    request: PlanRequest
    categories: dict[str, int]
    notes: list[str] = field(default_factory=list)
    # what a rank holds while the run samples in process (``rollout_terms``): a phase of its own, between steps
    rollout: dict[str, int] = field(default_factory=dict)
    # what each GPU's process keeps on the host (``host_terms``: offloaded, other dp ranks' rows): not in the GPU's
    host: dict[str, int] = field(default_factory=dict)

    @property
    def subtotal(self) -> int:
        return sum(self.categories.values())

    @property
    def rollout_subtotal(self) -> int:
        return sum(self.rollout.values())

    @property
    def rollout_total(self) -> int:
        return self.rollout_subtotal + _margin(self.rollout_subtotal)

    @property
    def rollout_fits(self) -> bool:
        return self.rollout_total <= self.request.gpu_mem_bytes

    @property
    def margin(self) -> int:
        return _margin(self.subtotal)

    @property
    def total(self) -> int:
        return self.subtotal + self.margin

    @property
    def fits(self) -> bool:
        return self.total <= self.request.gpu_mem_bytes

    def table(self) -> str:
        r = self.request
        lines = [
            f"{r.model_name}: {r.context:,} positions, G={r.group} x "
            + (f"{r.history:,}-token histories over {r.turns} turns, " if r.history else f"{r.completion} tokens, ")
            + f"{r.mode}, "
            f"{str(r.dtype).removeprefix('torch.')}, {r.gpus} GPUs x {r.gpu_mem_bytes / 1e9:.0f} GB "
            f"(dp={r.data_parallel}, cp={r.context_parallel}{'' if r.sharded or r.gpus == 1 else ', no fsdp'}), "
            f"optimizer {r.optimizer}"
            + (", offloaded to the host" if r.offload else "")
            + (f", beta={r.beta}" if r.beta else ""),
            engine_text(r.engine),
            f"{'per GPU':<{CATEGORY_WIDTH + 2}} {'GiB':>9}",
        ]
        lines += [f"  {name:<{CATEGORY_WIDTH}} {value / GIB:>9.2f}" for name, value in self.categories.items()]
        lines.append(f"  {'allocator margin (5% + 1 GiB)':<{CATEGORY_WIDTH}} {self.margin / GIB:>9.2f}")
        lines.append(f"  {'total':<{CATEGORY_WIDTH}} {_against(self.total, r.gpu_mem_bytes)}")
        if self.rollout:
            # serving the policy helps only a step that fits: otherwise the step's own verdict is what to act on
            serve = ": serve the policy instead (policy.served)" if self.fits else ""
            lines.append("rollouts in process (longstraw train's own sampler, on every cp rank; between steps)")
            lines += [f"  {name:<{CATEGORY_WIDTH}} {value / GIB:>9.2f}" for name, value in self.rollout.items()]
            total = _against(self.rollout_total, r.gpu_mem_bytes, not_fitting=serve)
            lines.append(f"  {'total (with the margin)':<{CATEGORY_WIDTH}} {total}")
        if self.host:
            lines.append("on the host, per GPU's process (not in the figures above)")
            lines += [f"  {name:<{CATEGORY_WIDTH}} {value / GIB:>9.2f}" for name, value in self.host.items()]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def engine_text(engine: EngineConfig) -> str:
    """The engine a plan plans, as its table prints it: each setting that differs from ``EngineConfig``'s defaults
    (a run config's ``engine:`` section gives them as written here)."""
    changed = engine.model_dump(exclude_defaults=True)
    said = ", ".join(f"{name}={value!r}" for name, value in changed.items())
    return f"engine: {said} (EngineConfig's defaults otherwise)" if said else "engine: EngineConfig's defaults"


def _against(total: int, capacity: int, not_fitting: str = "") -> str:
    """``total`` bytes against a GPU's ``capacity`` as the table prints them: both in GiB to the same two decimals
    (rounding both alike never shows a total that fits above its capacity, nor one that does not below it), the
    verdict (``not_fitting`` added to "does NOT fit"), and by how much where the rounded figures are the same."""
    shown, of = f"{total / GIB:.2f}", f"{capacity / GIB:.2f}"
    fits = total <= capacity
    verdict = "fits" if fits else f"does NOT fit{not_fitting}"
    if shown == of:
        verdict += f" (by {abs(capacity - total) / 2**20:,.1f} MiB)"
    return f"{shown:>9}  of {of} GiB: {verdict}"


def _margin(subtotal: int) -> int:
    """The allocator margin added to ``subtotal`` bytes: ``MARGIN_FRACTION`` of them and ``MARGIN_FIXED``."""
    return int(MARGIN_FRACTION * subtotal) + MARGIN_FIXED
