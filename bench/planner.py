"""The memory planner against the published LongStraw figures: ``longstraw plan`` for each row.

Published: on 8 H20 (96 GB) a Qwen3.6-27B layout completes grouped scoring and response backward at 2.1M positions
for G = 2 and 8, going from G = 2 to 8 adding 0.21 GB of peak allocated memory; a stress test reaches 4.46M; a
GLM-5.2 layout (78 layers) runs a 2.1M-token prompt on 32 H20. Writes ``bench/results/planner.json``.

``--agents``: README's agent target instead — G = 8 members sharing 8,192 tokens, each growing to 1M over 200 turns —
planned by the ``longstraw plan`` command lines README shows (``AGENT_COMMANDS``, through the CLI's own parser), to
``bench/results/planner_agents.json``; ``agent_table`` renders README's table from it.

    python -m bench.planner
    python -m bench.planner --agents
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from longstraw_agents.cli import flags_plan_request
from longstraw_agents.plan import GIB, PLAN_ENGINE, Plan, PlanRequest, longest_context, plan_memory

RESULTS = Path(__file__).parent / "results"
QWEN = PlanRequest(model="qwen3.6-27b", context=2_100_000, gpus=8, completion=1024)
GLM = PlanRequest(
    model="glm-5.2", context=2_100_000, gpus=32, completion=1024, engine=PLAN_ENGINE.updated(chunk_size=1024)
)


def row(label: str, plan: Plan) -> dict:
    r = plan.request
    print(
        f"{label:<58} {r.context / 1e6:>5.2f}M {r.mode:<8} G={r.group} opt={r.optimizer}"
        f"{' (fp32 masters)' if r.mixed else ''}{' offloaded' if r.offload else ''} "
        f"-> {plan.total / GIB:7.1f} GiB of {r.gpu_mem_bytes / GIB:.1f}: {'fits' if plan.fits else 'does NOT fit'}",
        flush=True,
    )
    request = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in asdict(r).items()}
    request["engine"] = r.engine.model_dump()
    categories = {k: v / GIB for k, v in plan.categories.items()}
    rollout = {k: v / GIB for k, v in plan.rollout.items()}
    return {
        "label": label, "request": request, "gib": categories, "total_gib": plan.total / GIB, "fits": plan.fits,
        "rollout_gib": rollout, "rollout_total_gib": plan.rollout_total / GIB, "rollout_fits": plan.rollout_fits,
        "host_gib": {k: v / GIB for k, v in plan.host.items()},
    }  # fmt: skip


AGENT = "--context 8192 --history 1M --turns 200 --group 8 --gpus 8"
AGENT_COMMANDS = {
    "detached": f"{AGENT} --mode detached",
    "detached, offloaded": f"{AGENT} --mode detached --offload",
    "exact": f"{AGENT} --mode exact",
    "exact, offloaded": f"{AGENT} --mode exact --offload",
    "exact, replicated walk": f"{AGENT} --mode exact --walk replicated",
    "exact, replicated walk, offloaded": f"{AGENT} --mode exact --walk replicated --offload",
}


def agent_rows() -> dict:
    """README's agent target, each ``longstraw plan`` command of ``AGENT_COMMANDS`` planned."""
    rows = {}
    for label, command in AGENT_COMMANDS.items():
        rows[label] = row(label, plan_memory(flags_plan_request(command.split()))) | {"command": command}
    return {"rows": rows}


def _fit(gib: float, fits: bool) -> str:
    return f"**{gib:.1f} GiB: fits**" if fits else f"{gib:.1f} GiB: does not fit"


def agent_table(record: dict) -> str:
    """README's table of the agent target from ``planner_agents.json``: per GPU, each mode with and without offload,
    and the rollouts in process (the detached plans': the sampler's state is the same in every mode)."""
    rows = record["rows"]

    def total(label: str, key: str = "total_gib", fits: str = "fits") -> str:
        return _fit(rows[label][key], rows[label][fits])

    detached, exact, replicated = rows["detached"], rows["exact"], rows["exact, replicated walk"]
    shards = sum(detached["rollout_gib"][k] for k in ("weights", "gradients", "optimizer state"))
    lines = [
        "| mode | per GPU |",
        "| --- | --- |",
        f"| detached | {total('detached')} (state {detached['gib']['captured state']:.1f}, graphs "
        f"{detached['gib'][GRAPH]:.1f}); with `--offload` {total('detached, offloaded')} |",
        f"| exact, wavefront walk | {total('exact')} (state gradient {exact['gib']['dState']:.1f}, layer inputs "
        f"{exact['gib']['layer inputs (wavefront walk)']:.1f}); with `--offload` {total('exact, offloaded')} |",
        f"| exact, `--walk replicated` | {total('exact, replicated walk')} (state gradient "
        f"{replicated['gib']['dState']:.1f}); with `--offload` {total('exact, replicated walk, offloaded')} (every "
        "rank recomputes every chunk of the walk) |",
        "| rollouts in process (the cp ranks sample together) | "
        f"{total('detached', 'rollout_total_gib', 'rollout_fits')} (the shards, their gradients and AdamW "
        f"{shards:.1f}, sampler state {detached['rollout_gib']['sampler state']:.1f} — each rank's eighth of 8 × 1M "
        f"positions —, {detached['rollout_gib']['gathered weights']:.1f} gathered); with `--offload` "
        f"{total('detached, offloaded', 'rollout_total_gib', 'rollout_fits')} |",
    ]
    return "\n".join(lines)


GRAPH = "one chunk's or branch's graph"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", action="store_true", help="README's agent target (planner_agents.json)")
    if parser.parse_args().agents:
        out = RESULTS / "planner_agents.json"
        out.write_text(json.dumps(agent_rows(), indent=1))
        print(agent_table(json.loads(out.read_text())))
        print(f"wrote {out}")
        return
    rows = []
    g2, g8 = plan_memory(replace(QWEN, group=2)), plan_memory(QWEN)
    rows += [row("Qwen3.6-27B, 8 x 96 GB, detached, G=2", g2), row("Qwen3.6-27B, 8 x 96 GB, detached, G=8", g8)]
    growth = (g8.total - g2.total) / 1e9
    print(f"G=2 -> 8 adds {growth:.3f} GB (published: 0.21 GB)")
    for group in (2, 8):  # the shards, their gradients and AdamW's state on the host (parallel.offload)
        plan = plan_memory(replace(QWEN, group=group, offload=True))
        rows.append(row(f"Qwen3.6-27B, 8 x 96 GB, detached, G={group}, offloaded", plan))
    for mode, optimizer, offload in [
        ("detached", "adamw", False),
        ("detached", "none", False),
        ("detached", "adamw", True),
        ("exact", "none", False),
        ("exact", "adamw", True),
    ]:
        plan = plan_memory(replace(QWEN, context=4_460_000, mode=mode, optimizer=optimizer, offload=offload))
        rows.append(row("Qwen3.6-27B stress, 8 x 96 GB" + (", offloaded" if offload else ""), plan))
    for optimizer, offload in (("adamw", False), ("none", False), ("adamw", True)):
        plan = plan_memory(replace(GLM, optimizer=optimizer, offload=offload))
        rows.append(row("GLM-5.2, 32 x 96 GB, detached" + (", offloaded" if offload else ""), plan))
    longest = {}  # (bf16 compute with fp32 master weights, as trainer.mixed_precision runs)
    replicated = replace(QWEN, engine=QWEN.engine.updated(wavefront_walk=False))
    for base, gpus, walk in [
        (QWEN, 8, "wavefront"),
        (QWEN, 32, "wavefront"),
        (replicated, 8, "replicated"),
        (replicated, 32, "replicated"),
        (GLM, 8, "wavefront"),
        (GLM, 32, "wavefront"),
    ]:
        for optimizer, offload in (("adamw", False), ("none", False), ("adamw", True)):
            request = replace(base, gpus=gpus, mode="exact", optimizer=optimizer, offload=offload)
            tokens, plan = longest_context(request)
            where = ", offloaded" if offload else ""
            key = f"{base.model}, {gpus} GPUs, exact ({walk} walk), optimizer {optimizer}{where}"
            longest[key] = tokens
            print(f"longest exact context: {key}: {tokens:,} positions ({plan.total / GIB:.1f} GiB)", flush=True)
    out = RESULTS / "planner.json"
    out.write_text(json.dumps({"rows": rows, "growth_g2_to_g8_gb": growth, "longest_exact": longest}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
