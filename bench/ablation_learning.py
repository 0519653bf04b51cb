"""Does exactness matter? Learning curves of GRPO in detached and exact mode, from the same init and seeds.

    python -m bench.ablation_learning [--quick] [--out bench/results] [--threads N] [--first-seeds N] [--tasks ...]

Per task and seed, a tiny hybrid policy (``qwen3_5``: GatedDeltaNet + full attention, random init) gets a supervised
warm start, and from those same weights GRPO runs once in each mode with the same task and sampling seeds (the
project's own training loop: ``app.run.Run``, ``app.training.rollout_and_train``). Held-out reward is the mean over
a fixed set of held-out tasks (``app.seeds.eval_task_seed``, the same for every run), measured every
``eval_every`` steps at the sampling temperature.

Tasks (fixed below before any comparison run; a null result is an answer, not a reason to retune):

- ``key_value_format_only``: ``LongStraw/KeyValueRecall-v0``; the warm start learns the answer format only
  (`FormatOnlyPolicy`'s decoy answers), so retrieving the value — which needs the prompt's state to encode the
  facts, the gradient detached mode drops — is left for GRPO.
- ``key_value_retrieval``: the same task after a warm start on the oracle's answers to other prompts (the
  warm-start seeds, never the held-out ones; the word pools are small, so a single key-value pair can recur by
  chance) — closer to a pretrained model, which already reads its prompt.
- ``calculator``: the control, ``LongStraw/Calculator-v0`` ("What is 7 + 5?" with the calculator tool), warm-started
  on scripted traces; its short prompt holds little to encode.

Prints per task and mode the final held-out reward (mean and standard deviation over seeds), the paired gap
exact − detached with its spread, seconds per GRPO step (rollout + update, and the update alone) and the peak
tracked tensor bytes of one update (measured on an extra step after the curve, so tracking never slows the timed
steps); naive mode, which has exact mode's gradient, gets only these cost figures (first seed, ``COST_STEPS``
steps). Writes ``ablation_learning.json`` and ``ablation_learning.png`` (held-out reward vs step and vs wall time;
``_quick`` with ``--quick``) to ``bench/results`` or ``--out``. Tiny random-init models cannot speak for pretrained
ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import gymnasium
import torch

from longstraw_agents.app.config import TrainConfig
from longstraw_agents.app.run import Run
from longstraw_agents.app.seeds import warm_start_seed
from longstraw_agents.app.training import evaluate, rollout_and_train
from longstraw_agents.envs import EASY_CALCULATOR_KWARGS, FormatOnlyPolicy, Policy, ScriptedPolicy, run_episode
from longstraw_agents.trainer.sft import SFTConfig, supervised_warm_start

RESULTS = Path(__file__).parent / "results"
MODES = ("detached", "exact")
COST_ONLY_MODE = "naive"
"""Naive mode has exact mode's gradient: it gets a time and memory row (first seed), not a learning curve."""
COST_STEPS = 10
FAMILY = "qwen3_5"


@dataclass(frozen=True)
class Task:
    """An environment setting and the policy whose traces warm-start the model."""

    env_id: str
    kwargs: dict[str, Any]
    warm_start_policy: Callable[[gymnasium.Env], Policy]
    max_new_tokens: int
    warm_start_scale: int = 1
    """Multiplies the settings' warm-start episodes and supervised steps."""


# One turn: the episode is a prompt and one answer (4 facts, 1-token values, a ~160-token user message).
KEY_VALUE_KWARGS: dict[str, Any] = {"num_facts": 4, "value_tokens": 1, "prompt_tokens": 160, "max_turns": 1}
TASKS: dict[str, Task] = {
    "key_value_format_only": Task("LongStraw/KeyValueRecall-v0", KEY_VALUE_KWARGS, FormatOnlyPolicy, 8),
    # Reading the prompt takes more supervision than the format: measured before any GRPO run, 512 episodes and 480
    # steps gave held-out reward 0.078 at seed 0 (retrieval begun: chance is 1/57, a random fact's value 1/4).
    "key_value_retrieval": Task("LongStraw/KeyValueRecall-v0", KEY_VALUE_KWARGS, ScriptedPolicy, 8, 4),
    "calculator": Task("LongStraw/Calculator-v0", {**EASY_CALCULATOR_KWARGS, "max_turns": 2}, ScriptedPolicy, 24),
}


@dataclass(frozen=True)
class Settings:
    """Sizes of one benchmark run (the full one and the suite's smoke test)."""

    seeds: tuple[int, ...]
    model: dict[str, Any] = field(default_factory=dict)  # tiny_qwen3_5 arguments
    warm_start_episodes: int = 128
    sft_steps: int = 120
    steps: int = 60
    eval_every: int = 10
    eval_episodes: int = 64
    groups_per_step: int = 2
    group_size: int = 8
    lr: float = 1e-3
    temperature: float = 1.0


# Fixed before the first comparison run.
FULL = Settings(seeds=(0, 1, 2, 3, 4), model={"hidden": 64, "layers": 4})
QUICK = Settings(
    seeds=(0,),
    model={"hidden": 32, "layers": 4},
    warm_start_episodes=4,
    sft_steps=2,
    steps=2,
    eval_every=2,
    eval_episodes=2,
    groups_per_step=1,
    group_size=2,
)


@dataclass
class Curve:
    """One run: held-out reward after ``steps[i]`` GRPO steps, reached after ``seconds[i]`` of GRPO steps."""

    seed: int
    steps: list[int] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    """Rollout + update of every GRPO step."""
    update_seconds: list[float] = field(default_factory=list)
    peak_bytes: int | None = None


def first_seeds(settings: Settings, count: int) -> Settings:
    """``settings`` run on the first ``count`` of its fixed seeds only."""
    if not 1 <= count <= len(settings.seeds):
        raise ValueError(f"--first-seeds must be between 1 and {len(settings.seeds)}, got {count}")
    return replace(settings, seeds=settings.seeds[:count])


def train_config(task: Task, mode: str, seed: int, settings: Settings, out: Path) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "env": {"id": task.env_id, "kwargs": task.kwargs},
            "model": {"preset": FAMILY, "overrides": settings.model},
            "groups_per_step": settings.groups_per_step,
            "steps": settings.steps,
            "trainer": {"G": settings.group_size, "mode": mode, "lr": settings.lr, "temperature": settings.temperature},
            "sampling": {"max_new_tokens": task.max_new_tokens, "temperature": settings.temperature},
            "eval_episodes": settings.eval_episodes,
            "output_dir": str(out),
            "seed": seed,
            "progress": False,
        }
    )


def warm_start(run: Run, task: Task, settings: Settings, seed: int) -> dict[str, torch.Tensor]:
    """Supervised warm start of the run's policy on ``task.warm_start_policy``'s traces; returns its weights."""
    env = run.env_factory()
    policy = task.warm_start_policy(env)
    episodes = settings.warm_start_episodes * task.warm_start_scale
    traces = [run_episode(env, policy, seed=warm_start_seed(k)) for k in range(episodes)]
    sft = SFTConfig(steps=settings.sft_steps * task.warm_start_scale, batch_size=8, lr=3e-3, seed=seed)
    supervised_warm_start(run.model, traces, sft)
    return {name: tensor.detach().clone() for name, tensor in run.model.state_dict().items()}


def learning_curve(run: Run, settings: Settings, seed: int, measure_memory: bool) -> Curve:
    curve = Curve(seed=seed)
    elapsed = 0.0

    def held_out(step: int) -> None:
        curve.steps.append(step)
        curve.seconds.append(elapsed)
        curve.reward.append(evaluate(run, settings.eval_episodes, step=step).reward_mean)

    held_out(0)
    for step in range(settings.steps):
        elapsed += timed_step(run, step, curve)
        if (step + 1) % settings.eval_every == 0 or step + 1 == settings.steps:
            held_out(step + 1)
    if measure_memory:
        curve.peak_bytes = tracked_peak(run, settings.steps)
    return curve


def timed_step(run: Run, step: int, curve: Curve) -> float:
    """One GRPO step; records its rollout + update and update seconds in ``curve``; returns its wall seconds."""
    start = time.perf_counter()
    record = rollout_and_train(run, step)
    elapsed = time.perf_counter() - start
    curve.step_seconds.append((record.rollout_seconds or 0.0) + record.metrics.seconds)
    curve.update_seconds.append(record.metrics.seconds)
    return elapsed


def tracked_peak(run: Run, step: int) -> int | None:
    """Peak tracked tensor bytes of one more GRPO step, outside the curve and its timings (tracking is slow)."""
    run.trainer.config = run.trainer.config.model_copy(update={"track_memory": True})
    return rollout_and_train(run, step).metrics.peak_bytes


def cost_only(run: Run, seed: int, steps: int) -> Curve:
    """Timed steps and the peak of one tracked step, without held-out evaluations."""
    curve = Curve(seed=seed)
    for step in range(steps):
        timed_step(run, step, curve)
    curve.peak_bytes = tracked_peak(run, steps)
    return curve


def run_task(name: str, task: Task, settings: Settings, workdir: Path) -> dict[str, list[Curve]]:
    """Every seed, every mode, each mode from the seed's same warm-started weights; naive's cost on the first."""
    curves: dict[str, list[Curve]] = {mode: [] for mode in (*MODES, COST_ONLY_MODE)}
    for seed in settings.seeds:
        init: dict[str, torch.Tensor] | None = None
        first = seed == settings.seeds[0]
        for mode in (*MODES, COST_ONLY_MODE) if first else MODES:
            run = Run(train_config(task, mode, seed, settings, workdir / f"{name}-{mode}-{seed}"))
            try:
                if init is None:
                    init = warm_start(run, task, settings, seed)
                else:
                    run.model.load_state_dict(init)
                if mode == COST_ONLY_MODE:
                    curve = cost_only(run, seed, min(COST_STEPS, settings.steps))
                else:
                    curve = learning_curve(run, settings, seed, measure_memory=first)
            finally:
                run.close()
            curves[mode].append(curve)
            if curve.reward:
                print(f"  {name} seed {seed} {mode:>8}: held-out reward {' '.join(f'{r:.2f}' for r in curve.reward)}")
    return curves


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.pstdev(values) if len(values) > 1 else 0.0


def summarise(curves: dict[str, list[Curve]]) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode in MODES:
        runs = curves[mode]
        final_mean, final_std = _mean_std([c.reward[-1] for c in runs])
        modes[mode] = {
            "final_reward_mean": final_mean,
            "final_reward_std": final_std,
            **cost(runs),
            "curves": [asdict(c) for c in runs],
        }
    gaps = [e.reward[-1] - d.reward[-1] for d, e in zip(curves["detached"], curves["exact"], strict=True)]
    gap_mean, gap_std = _mean_std(gaps)
    return {
        "modes": modes,
        COST_ONLY_MODE: cost(curves[COST_ONLY_MODE]),
        "final_gap_exact_minus_detached": {"mean": gap_mean, "std": gap_std, "per_seed": gaps},
    }


def cost(runs: list[Curve]) -> dict[str, Any]:
    """Mean seconds per step (rollout + update; update alone) over every run, and the first run's peak bytes."""
    return {
        "step_seconds_mean": statistics.fmean(s for c in runs for s in c.step_seconds),
        "update_seconds_mean": statistics.fmean(s for c in runs for s in c.update_seconds),
        "peak_bytes": runs[0].peak_bytes,
    }


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{'task':<24} {'mode':>8} {'held-out':>9} {'± std':>6} {'step s':>7} {'update s':>8} {'peak MiB':>9}")
    for name, task in results["tasks"].items():
        rows = [*task["modes"].items(), (COST_ONLY_MODE, task[COST_ONLY_MODE])]
        for mode, row in rows:
            peak = row["peak_bytes"]
            rewards = (
                f"{row['final_reward_mean']:>9.3f} {row['final_reward_std']:>6.3f}"
                if "final_reward_mean" in row
                else f"{'-':>9} {'-':>6}"
            )
            print(
                f"{name:<24} {mode:>8} {rewards} {row['step_seconds_mean']:>7.2f} {row['update_seconds_mean']:>8.2f} "
                f"{peak / 2**20 if peak is not None else float('nan'):>9.2f}"
            )
        gap = task["final_gap_exact_minus_detached"]
        print(f"{name:<24} {'gap':>8} {gap['mean']:>+9.3f} {gap['std']:>6.3f}  (exact - detached, paired by seed)")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = results["tasks"]
    fig, axes = plt.subplots(len(tasks), 2, figsize=(10, 3.2 * len(tasks)), squeeze=False)
    for row, (name, task) in enumerate(tasks.items()):
        for mode, data in task["modes"].items():
            runs = data["curves"]
            steps = runs[0]["steps"]
            mean = [statistics.fmean(c["reward"][i] for c in runs) for i in range(len(steps))]
            low = [min(c["reward"][i] for c in runs) for i in range(len(steps))]
            high = [max(c["reward"][i] for c in runs) for i in range(len(steps))]
            seconds = [statistics.fmean(c["seconds"][i] for c in runs) for i in range(len(steps))]
            for ax, x in ((axes[row][0], steps), (axes[row][1], seconds)):
                ax.plot(x, mean, marker="o", label=f"{mode} (mean of {len(runs)} seeds)")
                ax.fill_between(x, low, high, alpha=0.2)
        axes[row][0].set_xlabel("GRPO step")
        axes[row][1].set_xlabel("wall seconds of GRPO steps (mean over seeds)")
        for ax in axes[row]:
            ax.set_ylabel("held-out reward")
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(name)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one seed, two steps (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="directory for the JSON and the plot")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument(
        "--first-seeds", type=int, default=None, help="run only the first N of the fixed seeds (a shorter run)"
    )
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS), help="tasks to run")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = QUICK if args.quick else FULL
    if args.first_seeds is not None:
        try:
            settings = first_seeds(settings, args.first_seeds)
        except ValueError as err:
            parser.error(str(err))
    print(
        f"{FAMILY} {settings.model}, seeds {list(settings.seeds)}, {settings.steps} GRPO steps of "
        f"{settings.groups_per_step} groups x G={settings.group_size}; {settings.eval_episodes} held-out episodes"
    )
    results: dict[str, Any] = {"family": FAMILY, "settings": asdict(settings), "tasks": {}}
    with tempfile.TemporaryDirectory() as workdir:
        for name in args.tasks:
            task = TASKS[name]
            curves = run_task(name, task, settings, Path(workdir))
            results["tasks"][name] = {"env_id": task.env_id, "kwargs": task.kwargs, **summarise(curves)}
    print_table(results)
    suffix = "_quick" if args.quick else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ablation_learning{suffix}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / f"ablation_learning{suffix}.png")
    print(f"wrote {args.out / f'ablation_learning{suffix}.json'} and the plot beside it")


if __name__ == "__main__":
    main()
