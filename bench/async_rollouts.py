"""Asynchronous GRPO against the synchronous loop on a tool-latency-bound agent (issue 52), side by side in one run.

The agent (``SlowToolAgent``): the Calculator's prompt and tool, every turn answered after a fixed delay (the tool:
a test suite, a web page), and a reward a tiny random-init policy learns within a few GRPO steps — the share of its
turns whose first token id is even — so that the held-out curve shows learning per wall-clock second without a warm
start. The delay is calibrated first, in the same run: a short synchronous run without it measures a step's
training time T, its rollout's own time R0 and its environment steps S; the delay ``(T - R0) / S`` then makes a
rollout take about as long as a training step (2x is the ceiling of overlapping the two). ``longstraw train``'s loop
then runs the same config ``--steps`` steps synchronously and with ``max_staleness`` 1 and 2 (``--rounds`` rounds,
the order alternating), one after the other in this process, and compares their steps per minute: the loop's wall
time from its start to its last metrics line (the first step's rollout, which nothing overlaps, included). The
speed-up is the median over rounds of each round's ratio to its synchronous loop (the shared machine's load moves
from minute to minute; each run records its load average).

Every loop trains with truncated importance weights (``trainer.loss.importance: tis``; ``--importance``). With the
default, PPO's ratio clipped against the behaviour logprobs (``ratio``), the asynchronous loops stalled at this
learning rate: a step moves most sampled tokens' probabilities past the clip range, so a step-old token whose
advantage points the way the policy already moved gives no gradient.

Held-out reward vs wall time: the policy's weights are copied every ``--eval-every`` steps (instrumentation, a few
milliseconds), and after the runs each copy plays ``--eval-episodes`` held-out tasks (without the delay); the point is
drawn at the wall time of its copy.

    OMP_NUM_THREADS=1 python -m bench.async_rollouts [--steps 12] [--rounds 3] [--out bench/results/async.json]
    python -m bench.async_rollouts --plot bench/results/async.json   # README's table and figure from the JSON

Results: ``bench/results/async.json`` (with the machine's load averages before and after) and ``async_reward.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch
from pydantic import Field

from longstraw_agents.app import training
from longstraw_agents.app.config import TrainConfig
from longstraw_agents.app.records import MetricsRecord, StepRecord
from longstraw_agents.app.seeds import eval_sampling_seed, eval_task_seed
from longstraw_agents.engine import Engine
from longstraw_agents.envs import EASY_CALCULATOR_KWARGS
from longstraw_agents.envs.calculator import CalculatorConfig, CalculatorEnv
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.rollout import RolloutLimits, make_env_factory, rollout_groups
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.torch_sampler import TorchSampler
from longstraw_agents.trainer import GRPOTrainer

RESULTS = Path(__file__).parent / "results"
ENV_ID = "LongStrawBench/SlowToolAgent-v0"
MODES: dict[str, int | None] = {"sync": None, "async-1": 1, "async-2": 2}
TARGET_AT_1 = 1.6


class SlowToolConfig(CalculatorConfig):
    tool_delay_s: float = Field(0.0, ge=0.0, description="seconds the environment takes to answer each turn")


class SlowToolAgent(CalculatorEnv):
    """The Calculator's prompt and tool; each turn is answered after ``tool_delay_s``; an episode runs
    ``max_turns`` turns and scores the share of them whose first token id is even."""

    config_class = SlowToolConfig
    config: SlowToolConfig

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        time.sleep(self.config.tool_delay_s)
        observation, reward, terminated, truncated, info = super().step(action)
        if terminated or truncated:
            trajectory = self.trajectory
            turns = [s for s in trajectory.segments if s.role == "assistant"]
            trajectory.reward = reward = sum(len(s) > 0 and int(s.token_ids[0]) % 2 == 0 for s in turns) / len(turns)
        return observation, reward, terminated, truncated, info


if ENV_ID not in gymnasium.registry:
    gymnasium.register(ENV_ID, entry_point=SlowToolAgent)


def run_config(args: argparse.Namespace, out: Path, delay: float, staleness: int | None) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "env": {
                "id": ENV_ID,
                "kwargs": {**EASY_CALCULATOR_KWARGS, "max_turns": args.turns, "tool_delay_s": delay},
            },
            "model": {"preset": "llama", "overrides": {"hidden": args.hidden, "layers": args.layers}},
            "groups_per_step": args.groups,
            "max_staleness": staleness,
            "steps": args.steps,
            "trainer": {
                "group_size": args.group_size,
                "lr": args.lr,
                "mode": "exact",
                "loss": {"importance": args.importance},
            },
            "sampling": {"max_new_tokens": args.max_new_tokens},
            "output_dir": str(out),
            "checkpoint_every": args.steps,  # (one, after the timed loop)
            "seed": args.seed,
            "progress": False,
        }
    )


class Recorder:
    """What one run's loop did and when: the loop's start, each metrics line's arrival, and a copy of the policy's
    weights before the first step and every ``eval_every`` steps, with the wall time it was taken at."""

    def __init__(self, eval_every: int):
        self.eval_every = eval_every
        self.start: float | None = None
        self.load_at_start: float | None = None
        self.lines: list[tuple[float, StepRecord]] = []
        self.snapshots: list[tuple[float, int, dict[str, torch.Tensor]]] = []

    def on_metrics(self, record: MetricsRecord) -> None:
        if isinstance(record, StepRecord):
            self.lines.append((time.perf_counter(), record))

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Time the loop from its start (both loops enter ``training.async_rollouts`` just before their first step)
        and copy the weights as the steps go."""
        enter, train_step = training.async_rollouts, GRPOTrainer.train_step
        recorder = self

        @contextlib.contextmanager
        def timed(*a: Any, **k: Any) -> Iterator[Any]:
            recorder.start, recorder.load_at_start = time.perf_counter(), os.getloadavg()[0]
            with enter(*a, **k) as rollouts:
                yield rollouts

        def step(trainer: GRPOTrainer, groups: Any) -> Any:
            if trainer.step_count == 0:
                recorder.snapshot(trainer)
            metrics = train_step(trainer, groups)
            if trainer.step_count % recorder.eval_every == 0:
                recorder.snapshot(trainer)
            return metrics

        training.async_rollouts, GRPOTrainer.train_step = timed, step  # type: ignore[assignment]
        try:
            yield
        finally:
            training.async_rollouts, GRPOTrainer.train_step = enter, train_step  # type: ignore[assignment]

    def snapshot(self, trainer: GRPOTrainer) -> None:
        weights = {name: p.detach().clone() for name, p in trainer.model.state_dict().items()}
        self.snapshots.append((time.perf_counter(), trainer.step_count, weights))

    def summary(self) -> dict[str, Any]:
        assert self.start is not None
        steps = [record for _, record in self.lines]
        seconds = self.lines[-1][0] - self.start
        steady = self.lines[-1][0] - self.lines[0][0]  # (from the first step's end: the pipeline is full)
        stale = [r.staleness_max for r in steps if r.staleness_max is not None]
        return {
            "steps": len(steps),
            "load_average_1min": [self.load_at_start, os.getloadavg()[0]],  # (at the loop's start and end)
            "loop_seconds": seconds,
            "steps_per_minute": 60.0 * len(steps) / seconds,
            "steady_steps_per_minute": 60.0 * (len(steps) - 1) / steady if len(steps) > 1 else None,
            "train_seconds_mean": statistics.mean(r.metrics.seconds for r in steps),
            "waited_seconds_mean": statistics.mean(r.rollout_seconds or 0.0 for r in steps),
            "staleness_max": max(stale) if stale else None,
            "staleness_mean": statistics.mean(r.staleness_mean or 0.0 for r in steps) if stale else None,
            "groups_dropped_stale": sum(r.groups_dropped_stale or 0 for r in steps),
            "reward_mean": [r.metrics.reward_mean for r in steps],
        }


def held_out_reward(weights: dict[str, torch.Tensor], args: argparse.Namespace) -> float:
    """Mean reward of ``--eval-episodes`` held-out tasks (the runs' evaluation seeds), without the tool delay."""
    tokenizer = load_tokenizer()
    model = tiny_model("llama", vocab_size=tokenizer.vocab_size, hidden=args.hidden, layers=args.layers).eval()
    model.load_state_dict(weights)
    config = run_config(args, Path("unused"), 0.0, None)
    factory = make_env_factory(ENV_ID, {**config.env.kwargs, "tokenizer": tokenizer})
    sampling = config.sampling.model_copy(update={"seed": eval_sampling_seed()})
    sampler = TorchSampler(Engine(model), [tokenizer.eos_token_id], sampling)
    seeds = [eval_task_seed(k) for k in range(args.eval_episodes)]
    limits = RolloutLimits(args.max_new_tokens)
    groups = rollout_groups(factory, sampler, seeds, 1, limits, group_prefix="eval-", progress=False)
    return float(np.mean([t.reward or 0.0 for g in groups for t in g]))


def calibrate(args: argparse.Namespace, work: Path) -> dict[str, float]:
    """A short synchronous run without the delay: a step's training time T, rollout time R0 and environment steps
    S (turns played, per step); the delay ``(T - R0) / S`` makes a rollout take T."""
    recorder = Recorder(eval_every=10**9)
    probe = argparse.Namespace(**{**vars(args), "steps": args.calibration_steps})
    with recorder.watching():
        training.train(run_config(probe, work / "calibration", 0.0, None), on_metrics=recorder.on_metrics)
    steps = [record for _, record in recorder.lines][1:] or [record for _, record in recorder.lines]
    train_s = statistics.mean(r.metrics.seconds for r in steps)
    rollout_s = statistics.mean(r.rollout_seconds or 0.0 for r in steps)
    with Store.open(work / "calibration" / "trajectories.db", create=False) as store:
        turns = sum(sum(s.role == "assistant" for s in t.segments) for t in store.episodes())
    env_steps = turns / len(recorder.lines)
    delay = max(0.0, (train_s - rollout_s) / env_steps)
    return {"train_seconds": train_s, "rollout_seconds": rollout_s, "env_steps": env_steps, "tool_delay_s": delay}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="bench-async-"))
    try:
        calibration = calibrate(args, work)
        delay = calibration["tool_delay_s"] if args.tool_delay_s is None else args.tool_delay_s
        print(f"calibration: {json.dumps(calibration)}; tool delay {delay * 1000:.1f} ms", flush=True)
        rounds: list[dict[str, Any]] = []
        curves: dict[str, list[dict[str, float]]] = {}
        for r in range(args.rounds):
            results: dict[str, Any] = {}
            for mode in list(MODES) if r % 2 == 0 else list(reversed(MODES)):
                recorder = Recorder(args.eval_every)
                out = work / f"round{r}-{mode}"
                with recorder.watching():
                    training.train(run_config(args, out, delay, MODES[mode]), on_metrics=recorder.on_metrics)
                results[mode] = recorder.summary()
                print(f"round {r + 1} {mode}: {results[mode]['steps_per_minute']:.1f} steps/min", flush=True)
                if r == 0:
                    assert recorder.start is not None
                    curves[mode] = [
                        {"seconds": at - recorder.start, "step": step, "reward": held_out_reward(weights, args)}
                        for at, step, weights in recorder.snapshots
                    ]
                shutil.rmtree(out, ignore_errors=True)
            rounds.append(results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "machine": {
            "cpus": os.cpu_count(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(),
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
        },
        "calibration": calibration,
        "tool_delay_s": delay,
        "rounds": rounds,
        "speedup": {mode: _median_ratio(rounds, mode, "steps_per_minute") for mode in MODES},
        "steady_speedup": {mode: _median_ratio(rounds, mode, "steady_steps_per_minute") for mode in MODES},
        "held_out": curves,
    }


def _median_ratio(rounds: list[dict[str, Any]], mode: str, key: str) -> float | None:
    """The median over rounds of ``mode``'s ``key`` over the synchronous loop's in the same round: the machine's
    load changes from minute to minute, and the median keeps one round run under another job's burst from
    deciding the figure."""
    ratios = [r[mode][key] / r["sync"][key] for r in rounds if r[mode][key] and r["sync"][key]]
    return statistics.median(ratios) if ratios else None


def table(result: dict[str, Any]) -> str:
    """README's table: steps per minute of each loop (each round), and the speed-up over the synchronous loop (the
    median of the rounds' ratios)."""
    rows = [
        "| loop | steps/min (each round) | speed-up | from step 2 on | max staleness | waited / trained per step |",
        "|---|---|---|---|---|---|",
    ]
    for mode, bound in MODES.items():
        runs = [r[mode] for r in result["rounds"]]
        rates = ", ".join(f"{run['steps_per_minute']:.1f}" for run in runs)
        stale = "-" if bound is None else str(max(run["staleness_max"] or 0 for run in runs))
        waited = statistics.mean(run["waited_seconds_mean"] for run in runs)
        trained = statistics.mean(run["train_seconds_mean"] for run in runs)
        steady = result["steady_speedup"][mode]
        name = "synchronous" if bound is None else f"max_staleness {bound}"
        rows.append(
            f"| {name} | {rates} | {result['speedup'][mode]:.2f}x | {steady:.2f}x | {stale} "
            f"| {waited:.2f} s / {trained:.2f} s |"
        )
    return "\n".join(rows)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for mode, points in result["held_out"].items():
        bound = MODES[mode]
        label = "synchronous" if bound is None else f"max_staleness {bound}"
        ax.plot([p["seconds"] for p in points], [p["reward"] for p in points], marker="o", label=label)
    ax.set_xlabel("wall time of the training loop (s)")
    ax.set_ylabel(f"held-out reward ({result['settings']['eval_episodes']} episodes)")
    delay_ms = 1000 * result["tool_delay_s"]
    ax.set_title(f"a {delay_ms:.0f} ms tool, {result['settings']['steps']} GRPO steps per loop", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2, help="turns per episode (each answered by the slow tool)")
    parser.add_argument("--max-new-tokens", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-2)
    parser.add_argument(
        "--importance",
        choices=["ratio", "tis", "icepop"],
        default="tis",
        help="the loss's off-policy correction (trainer.loss.importance), in every loop",
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--calibration-steps", type=int, default=3)
    parser.add_argument("--tool-delay-s", type=float, default=None, help="a fixed delay instead of the calibrated one")
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--eval-episodes", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="toy sizes: a smoke run of the code, no measurement")
    parser.add_argument("--out", type=Path, default=RESULTS / "async.json")
    parser.add_argument("--plot", type=Path, default=None, help="only print the table and draw the figure of this JSON")
    args = parser.parse_args()
    if args.plot is not None:
        result = json.loads(args.plot.read_text())
        plot(result, args.plot.with_name("async_reward.png"))
        print(table(result))
        return
    if args.quick:
        args.steps, args.rounds, args.groups, args.group_size, args.hidden, args.layers = 2, 1, 1, 2, 16, 1
        args.calibration_steps, args.eval_every, args.eval_episodes = 1, 2, 2
    result = measure(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    plot(result, args.out.with_name("async_reward.png"))
    print(table(result))
    at_1 = result["speedup"]["async-1"]
    verdict = "meets" if at_1 >= TARGET_AT_1 else "MISSES"
    print(f"max_staleness 1: {at_1:.3f}x the synchronous loop's steps per minute ({verdict} the {TARGET_AT_1}x target)")
    machine = result["machine"]
    print(f"load average before {machine['load_average_before']}, after {machine['load_average_after']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
