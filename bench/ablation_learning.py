"""Does exactness matter? Learning curves of GRPO in detached and exact mode, from the same init and seeds.

    python -m bench.ablation_learning [--quick] [--jobs N] [--out bench/results] [--threads N] [--first-seeds N]
                                      [--tasks ...]

Per task and seed, a tiny hybrid policy (``qwen3_5``: GatedDeltaNet + full attention, random init) gets a supervised
start (a warm start per seed, or a pretraining shared by the seeds), and from those same weights GRPO runs once in
each mode with the same task and sampling seeds (the project's own training loop: ``app.run.Run``,
``app.training.rollout_and_train``). Held-out reward is the mean over
a fixed set of held-out tasks (``app.seeds.eval_task_seed``, the same for every run), measured every
``eval_every`` steps at the sampling temperature.

Tasks (a null result is an answer, not a reason to retune):

- ``key_value_format_only``: ``LongStraw/KeyValueRecall-v0``; the warm start learns the answer format only
  (`FormatOnlyPolicy`'s decoy answers), so retrieving the value — which needs the prompt's state to encode the
  facts, the gradient detached mode drops — is left for GRPO.
- ``key_value_retrieval``: the same task from a model first trained on other facts — closer to a pretrained model, which
  already reads its prompt: supervised pretraining on documents of one task's facts followed by 16 questions about them
  (`drill_document`, then `short_conversation_document` and `conversation_document`, each with drills mixed in:
  `Mixture`; facts from a generator stream of their own, never an environment seed: single key-value pairs recur, as the
  word pools are small, but no held-out task's set of facts), once per benchmark run and shared by the seeds, with no
  warm start on episodes after it.
- ``calculator``: the control, ``LongStraw/Calculator-v0`` ("What is 7 + 5?" with the calculator tool), warm-started
  on scripted traces; its short prompt holds little to encode.

Prints per task and mode the final held-out reward (mean and standard deviation over seeds), the paired gap
exact − detached with its spread, seconds per GRPO step (rollout + update, and the update alone) and the peak
tracked tensor bytes of one update (measured on an extra step after the curve, so tracking never slows the timed
steps); naive mode, which has exact mode's gradient, gets only these cost figures (first seed, ``COST_STEPS``
steps). On the key-value tasks it also measures the gradient geometry of ``bench.ablation`` on trained policies
(`prefix_geometry`): cosine and relative L2 distance between the detached and the exact gradient of groups the
first seed's policy samples itself — after its warm start and after GRPO in each mode — with the prompt stretched
to each of ``Settings.geometry_lengths`` (up to 16,384 tokens). ``--jobs N`` runs N tasks at once, a process each.
Writes ``ablation_learning.json`` and ``ablation_learning.png`` (held-out reward vs step and vs wall time;
``_quick`` with ``--quick``) to ``bench/results`` or ``--out``. Tiny random-init models cannot speak for pretrained
ones.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import torch

from bench.common import compare, flat_grad
from longstraw_agents.app.config import TrainConfig
from longstraw_agents.app.run import Run
from longstraw_agents.app.seeds import eval_sampling_seed, eval_task_seed, warm_start_seed
from longstraw_agents.app.training import evaluate, rollout_and_train
from longstraw_agents.envs import EASY_CALCULATOR_KWARGS, FormatOnlyPolicy, Policy, ScriptedPolicy, run_episode
from longstraw_agents.envs.answers import ANSWER_CLOSE, ANSWER_OPEN
from longstraw_agents.envs.key_value import KeyValueRecallEnv, KeyValueTask
from longstraw_agents.envs.policy import unwrap_tool_env
from longstraw_agents.rollout import RolloutLimits, make_env_factory, rollout_group
from longstraw_agents.trainer.grpo import grpo_backward_trajectories
from longstraw_agents.trainer.sft import SFTConfig, supervised_warm_start
from longstraw_agents.trajectory import Segment, Trajectory

RESULTS = Path(__file__).parent / "results"
MODES = ("detached", "exact")
COST_ONLY_MODE = "naive"
"""Naive mode has exact mode's gradient: it gets a time and memory row (first seed), not a learning curve."""
COST_STEPS = 10
FAMILY = "qwen3_5"


DocumentMaker = Callable[[gymnasium.Env, np.random.Generator, int], Trajectory]
"""Makes one pretraining document from an environment, a generator and a number of questions."""


@dataclass(frozen=True)
class Task:
    """An environment setting and the policy whose traces warm-start the model."""

    env_id: str
    kwargs: dict[str, Any]
    warm_start_policy: Callable[[gymnasium.Env], Policy] | None
    """Whose episodes each seed's warm start learns (None: none, the pretrained model is every seed's start)."""
    max_new_tokens: int
    prompt_length_argument: str | None = None
    """The environment argument that sets the prompt's length: the gradient geometry is measured at longer prompts
    (``Settings.geometry_lengths``) on tasks that have one."""
    pretraining: tuple[DocumentMaker, ...] = ()
    """Stages of supervised pretraining, each on its own documents, run once per benchmark run before every seed's
    warm start (sizes: ``Settings.pretraining``)."""


def _task_of(
    env: gymnasium.Env, rng: np.random.Generator, caller: str, filler: bool
) -> tuple[KeyValueRecallEnv, KeyValueTask]:
    """``env``'s task generator run on ``rng`` (not an environment seed), with or without its filler lines."""
    inner = unwrap_tool_env(env)
    if not isinstance(inner, KeyValueRecallEnv):
        raise TypeError(f"{caller} reads KeyValueRecallEnv tasks, got {type(inner).__name__}")
    task = inner.make_task(rng)
    return inner, task if filler else dataclasses.replace(task, filler=())


def drill_document(env: gymnasium.Env, rng: np.random.Generator, questions: int) -> Trajectory:
    """One task's facts as plain text (no filler), then ``questions`` questions about them, each followed at once by
    its answer (``What is the value of pop?<answer> raise</answer>``; the answer marks are the single tokens a
    policy writes, as in the episodes): loss on the answers only. One token (``?<answer>``) lies between the asked
    key and the value, as one (`` =``) lies between a fact's key and value: a tiny model learns to match keys here
    before it learns to carry the asked key across a chat turn's boundary."""
    inner, task = _task_of(env, rng, "drill_document", filler=False)
    encode = inner.tokenizer.encode
    answer_open, answer_close = (encode(mark, allow_special=True) for mark in (ANSWER_OPEN, ANSWER_CLOSE))
    segments = [Segment("user", encode(inner.facts_text(task) + "\n"))]
    for asked in rng.integers(len(task.facts), size=questions):
        key, value = task.facts[asked]
        segments.append(Segment("user", encode(inner.question(key)) + answer_open))
        segments.append(Segment("assistant", encode(value) + answer_close + encode("\n")))
    return Trajectory(segments)


def conversation_document(env: gymnasium.Env, rng: np.random.Generator, questions: int) -> Trajectory:
    """A conversation about one task (its facts among filler lines, as an episode has them) in the episodes' chat
    layout: the episode's system prompt and user message, the oracle's answer, then ``questions - 1`` more
    questions about the same facts as user turns, each answered as the oracle answers; loss on the answers only."""
    return _conversation(env, rng, questions, "conversation_document", filler=True)


def short_conversation_document(env: gymnasium.Env, rng: np.random.Generator, questions: int) -> Trajectory:
    """`conversation_document` without the filler lines: the facts alone."""
    return _conversation(env, rng, questions, "short_conversation_document", filler=False)


def _conversation(
    env: gymnasium.Env, rng: np.random.Generator, questions: int, caller: str, filler: bool
) -> Trajectory:
    inner, task = _task_of(env, rng, caller, filler)
    inner.reset(seed=int(rng.integers(1 << 31)))  # for the episode's system prompt (its tools): not the task's source
    messages = [
        {"role": "system", "content": inner.system_prompt(task)},
        {"role": "user", "content": inner.user_prompt(task)},
    ]
    for turn, asked in enumerate([task.asked, *rng.integers(len(task.facts), size=questions - 1)]):
        if turn:
            messages.append({"role": "user", "content": inner.question(task.facts[asked][0])})
        (answer,) = inner.scripted_turns(dataclasses.replace(task, asked=int(asked)))
        messages.append({"role": "assistant", "content": answer})
    return inner.formatter.render_messages(messages, add_generation_prompt=False)


@dataclass(frozen=True)
class Mixture:
    """Documents of ``learned``, each replaced by one of ``rehearsed`` with probability ``rehearsal``: a stage that
    learns a new layout while it keeps an earlier stage's skill in use. (Measured after 1,200 drill steps, loss per
    answer token: conversations without filler alone stay at 0.42 by step 400, about what choosing among the
    prompt's values costs; half conversations, half drills fall to 0.03 by step 400 and 0.004 by step 700 — a
    mixed batch's mean, so the conversations' own loss is at most about twice that.)"""

    learned: DocumentMaker
    rehearsed: DocumentMaker
    rehearsal: float

    def __post_init__(self) -> None:
        if not 0.0 <= self.rehearsal <= 1.0:
            raise ValueError(f"Mixture.rehearsal is a probability, between 0 and 1; got {self.rehearsal}")

    def __call__(self, env: gymnasium.Env, rng: np.random.Generator, questions: int) -> Trajectory:
        make = self.rehearsed if rng.random() < self.rehearsal else self.learned
        return make(env, rng, questions)

    @property
    def __name__(self) -> str:  # the stage's label in the progress lines, as a function's name is
        return f"{self.learned.__name__} + {self.rehearsal:.0%} {self.rehearsed.__name__}"


# One turn: the episode is a prompt and one answer (4 facts, 1-token values, a ~160-token user message).
KEY_VALUE_KWARGS: dict[str, Any] = {"num_facts": 4, "value_tokens": 1, "prompt_tokens": 160, "max_turns": 1}
TASKS: dict[str, Task] = {
    "key_value_format_only": Task(
        "LongStraw/KeyValueRecall-v0", KEY_VALUE_KWARGS, FormatOnlyPolicy, 8, prompt_length_argument="prompt_tokens"
    ),
    # Documents, not episodes (measured before the comparison runs of each pretraining): oracle episodes do not teach
    # the tiny model to read its prompt (512 to 4,096 episodes, up to 2,000 steps, lr up to 1e-2, or 2 facts without
    # filler: held-out <= 0.08, mostly values the prompt does not hold; one answer per episode is little signal), nor do
    # conversations of 16 questions from the random init (loss 0.65 after 1,000 steps). A drill, the asked key one token
    # from its value, learns to match keys: loss per answer token about 0.6 (no better than choosing among the prompt's
    # values: ln 4 over 3 answer tokens, 0.46) until step 600, 0.01 by step 1,100. Conversations alone then do not (0.42
    # by step 400); with drills mixed in (`Mixture`) they do (mixed batches 0.004 by step 700). The first pretraining of
    # this regime (its comparison run is in README) spelled the drill's answer marks as text, four tokens between the
    # asked key and the value, and ran the stages one after another: it never matched keys (conversations 0.42 per
    # token, also at hidden 128 or with 8 layers), and its model answered a random one of the prompt's values.
    "key_value_retrieval": Task(
        "LongStraw/KeyValueRecall-v0",
        KEY_VALUE_KWARGS,
        None,
        8,
        prompt_length_argument="prompt_tokens",
        pretraining=(
            drill_document,
            Mixture(short_conversation_document, drill_document, rehearsal=0.5),
            Mixture(conversation_document, drill_document, rehearsal=0.25),
        ),
    ),
    "calculator": Task("LongStraw/Calculator-v0", {**EASY_CALCULATOR_KWARGS, "max_turns": 2}, ScriptedPolicy, 24),
}


@dataclass(frozen=True)
class Pretraining:
    """Sizes of a task's supervised pretraining (``Task.pretraining``), run once and shared by the seeds, as one
    pretrained model is the start of every seed's warm start and GRPO run."""

    steps: tuple[int, ...] = (1200, 1000, 500)
    """Optimizer steps of each stage (``Task.pretraining``'s documents, in order)."""
    documents: int = 4096
    """Documents per stage, drawn before it."""
    questions: int = 16
    batch_size: int = 16
    lr: float = 1e-3
    seed: int = 0
    """Seeds the documents' facts (a stream of its own, never an environment seed: held-out and warm-start tasks
    come from seeds, these from this stream, so only single key-value pairs recur — the pools are 57 x 57, so each
    recurs about 15 times, with every value as often — never a task's set of facts) and, plus the stage's index,
    each stage's batches."""


@dataclass(frozen=True)
class Settings:
    """Sizes of one benchmark run (the full one and the suite's smoke test)."""

    seeds: tuple[int, ...]
    model: dict[str, Any] = field(default_factory=dict)  # tiny_qwen3_5 arguments
    pretraining: Pretraining = field(default_factory=Pretraining)
    warm_start_episodes: int = 128
    sft_steps: int = 120
    steps: int = 60
    eval_every: int = 10
    eval_episodes: int = 64
    groups_per_step: int = 2
    group_size: int = 8
    lr: float = 1e-3
    temperature: float = 1.0
    geometry_lengths: tuple[int, ...] = (160, 1024, 4096, 16384)
    geometry_groups: int = 2


# The GRPO settings and seeds were fixed before the first comparison run, the geometry sizes before the first run
# of the pretrained start. Its first pretraining did not give what the regime asks for, a model that retrieves (it
# never matched keys: see TASKS), so it was rebuilt; this one was fixed before its own comparison run.
FULL = Settings(seeds=(0, 1, 2, 3, 4), model={"hidden": 64, "layers": 4})
QUICK = Settings(
    seeds=(0,),
    model={"hidden": 32, "layers": 4},
    pretraining=Pretraining(steps=(2, 2, 2), documents=4, questions=2, batch_size=2),
    warm_start_episodes=4,
    sft_steps=2,
    steps=2,
    eval_every=2,
    eval_episodes=2,
    groups_per_step=1,
    group_size=2,
    geometry_lengths=(32, 64),
    geometry_groups=1,
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


def pretrain(run: Run, task: Task, sizes: Pretraining) -> dict[str, torch.Tensor]:
    """``task.pretraining``'s stages learned in turn by the run's policy from its init; returns the weights."""
    env, rng = run.env_factory(), np.random.default_rng(sizes.seed)
    for stage, (make_document, steps) in enumerate(zip(task.pretraining, sizes.steps, strict=True)):
        documents = [make_document(env, rng, sizes.questions) for _ in range(sizes.documents)]
        config = SFTConfig(steps=steps, batch_size=sizes.batch_size, lr=sizes.lr, seed=sizes.seed + stage)
        supervised_warm_start(
            run.model, documents, config, on_step=_every(100, f"pretraining {make_document.__name__}")
        )
    return weights_of(run.model)


def _every(steps: int, label: str) -> Callable[[int, float], None]:
    def report(step: int, loss: float) -> None:
        if (step + 1) % steps == 0:
            print(f"  {label} step {step + 1}: loss {loss:.3f}", flush=True)

    return report


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def warm_start(run: Run, task: Task, settings: Settings, seed: int) -> dict[str, torch.Tensor]:
    """Supervised warm start of the run's policy on ``task.warm_start_policy``'s traces; returns its weights."""
    if task.warm_start_policy is None:
        return weights_of(run.model)
    env = run.env_factory()
    policy = task.warm_start_policy(env)
    traces = [run_episode(env, policy, seed=warm_start_seed(k)) for k in range(settings.warm_start_episodes)]
    supervised_warm_start(run.model, traces, SFTConfig(steps=settings.sft_steps, batch_size=8, lr=3e-3, seed=seed))
    return weights_of(run.model)


@dataclass
class Geometry:
    """Detached vs exact GRPO gradients of one policy, per prompt length: mean cosine and relative L2 distance over
    the ``groups`` groups the policy samples itself (held-out tasks) whose exact gradient does not vanish, and how
    many of them had rewards of their own that differed (the others get a seeded uniform draw: a group that is all
    right or all wrong has no GRPO gradient to compare). ``policy`` "warm start" is the weights GRPO starts from
    (the pretrained model where a task has no warm start)."""

    policy: str
    prompt_tokens: list[int] = field(default_factory=list)
    cosine: list[float | None] = field(default_factory=list)
    """None where the gradient vanishes (`VANISHING`): a policy that answers every sample alike has nothing to
    compare, and the cosine of two rounding errors says nothing."""
    relative_l2: list[float | None] = field(default_factory=list)
    exact_norm: list[float] = field(default_factory=list)
    """Mean L2 norm of the exact gradient."""
    groups: int = 0
    groups_with_own_rewards: list[int] = field(default_factory=list)


def prefix_geometry(run: Run, name: str, task: Task, policy: str, settings: Settings) -> Geometry:
    """The cosine ablation (``bench.ablation``) on a trained policy and its own task: the groups are sampled by the
    run's policy on ``task`` with the prompt stretched to each length; the gradients are computed from the same
    trajectories in both modes and leave no trace in the run (``param.grad`` cleared)."""
    assert task.prompt_length_argument is not None
    lengths, groups = settings.geometry_lengths, settings.geometry_groups
    geometry = Geometry(policy=policy, groups=groups)
    limits = RolloutLimits(task.max_new_tokens, run.max_context)
    loss, chunk = run.config.trainer.loss, run.config.trainer.chunk_size
    for length in lengths:
        kwargs = {**task.kwargs, task.prompt_length_argument: length}
        env_factory = make_env_factory(task.env_id, kwargs, limits)
        cosines, distances, norms, own = [], [], [], 0
        for g in range(groups):
            with run.sampling(seed=eval_sampling_seed() + g) as sampler:
                assert sampler is not None  # (one process)
                group = rollout_group(
                    env_factory, sampler, run.config.trainer.group_size, eval_task_seed(g), f"geo-{g}", limits
                )
            rewards = [t.reward or 0.0 for t in group]
            if len(set(rewards)) > 1:
                own += 1
            else:
                rewards = np.random.default_rng(g).random(len(group)).tolist()
            flat = {}
            for mode in MODES:
                run.model.zero_grad(set_to_none=True)
                grpo_backward_trajectories(run.model, group, rewards, mode, config=loss, chunk_size=chunk)
                flat[mode] = flat_grad(run.model).double()
            run.model.zero_grad(set_to_none=True)
            norms.append(float(flat["exact"].norm()))
            compared = compare(flat["detached"], flat["exact"])
            if compared is not None:
                cosines.append(compared[0])
                distances.append(compared[1])
        geometry.prompt_tokens.append(length)
        geometry.cosine.append(statistics.fmean(cosines) if cosines else None)
        geometry.relative_l2.append(statistics.fmean(distances) if distances else None)
        geometry.exact_norm.append(statistics.fmean(norms))
        geometry.groups_with_own_rewards.append(own)
        print(
            f"  {name} geometry, {policy}, {length} prompt tokens: cosine {geometry.cosine[-1]}, "
            f"exact gradient norm {geometry.exact_norm[-1]:.2e}",
            flush=True,
        )
    return geometry


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


def run_task(name: str, task: Task, settings: Settings, workdir: Path) -> tuple[dict[str, list[Curve]], list[Geometry]]:
    """Every seed, every mode, each mode from the seed's same warm-started weights; naive's cost on the first; the
    gradient geometry of the first seed's warm start and of its policy after GRPO in each mode."""
    curves: dict[str, list[Curve]] = {mode: [] for mode in (*MODES, COST_ONLY_MODE)}
    geometry: list[Geometry] = []
    measures_geometry = task.prompt_length_argument is not None
    pretrained: dict[str, torch.Tensor] | None = None
    for seed in settings.seeds:
        init: dict[str, torch.Tensor] | None = None
        first = seed == settings.seeds[0]
        for mode in (*MODES, COST_ONLY_MODE) if first else MODES:
            run = Run(train_config(task, mode, seed, settings, workdir / f"{name}-{mode}-{seed}"))
            try:
                if task.pretraining and pretrained is None:
                    pretrained = pretrain(run, task, settings.pretraining)
                if init is None:
                    if pretrained is not None:
                        run.model.load_state_dict(pretrained)
                    init = warm_start(run, task, settings, seed)
                    if first and measures_geometry:
                        geometry.append(prefix_geometry(run, name, task, "warm start", settings))
                else:
                    run.model.load_state_dict(init)
                if mode == COST_ONLY_MODE:
                    curve = cost_only(run, seed, min(COST_STEPS, settings.steps))
                else:
                    curve = learning_curve(run, settings, seed, measure_memory=first)
                    if first and measures_geometry:
                        geometry.append(prefix_geometry(run, name, task, f"after {mode} GRPO", settings))
            finally:
                run.close()
            curves[mode].append(curve)
            if curve.reward:
                rewards = " ".join(f"{r:.2f}" for r in curve.reward)
                print(f"  {name} seed {seed} {mode:>8}: held-out reward {rewards}", flush=True)
    return curves, geometry


def results_of(name: str, settings: Settings, threads: int | None) -> dict[str, Any]:
    """One task's runs, summarised: everything a worker process does with ``--jobs``."""
    if threads is not None:
        torch.set_num_threads(threads)
    task = TASKS[name]
    with tempfile.TemporaryDirectory() as workdir:
        curves, geometry = run_task(name, task, settings, Path(workdir))
    summary = summarise(curves)
    return {"env_id": task.env_id, "kwargs": task.kwargs, **summary, "geometry": [asdict(g) for g in geometry]}


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


def _figure(value: float | None, spec: str) -> str:
    return "vanishing" if value is None else format(value, spec)


def print_geometry(results: dict[str, Any]) -> None:
    """Per task with a prompt-length argument and per policy: cosine(detached, exact) at each prompt length."""
    for name, task in results["tasks"].items():
        for row in task["geometry"]:
            figures = zip(row["prompt_tokens"], row["cosine"], row["relative_l2"], strict=True)
            cells = "  ".join(f"{n}: {_figure(c, '.4f')} ({_figure(d, '.3f')})" for n, c, d in figures)
            print(f"{name:<24} {row['policy']:<22} cosine (relative L2) by prompt tokens  {cells}")


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
    parser.add_argument("--jobs", type=int, default=1, help="tasks run at once, a process each (one thread each)")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
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
    if args.jobs == 1:
        task_results = [results_of(name, settings, args.threads) for name in args.tasks]
    else:  # a process per task, one thread each unless told: the tasks share no state
        spawn = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=spawn) as pool:
            threads = [args.threads or 1] * len(args.tasks)
            task_results = list(pool.map(results_of, args.tasks, [settings] * len(args.tasks), threads))
    results["tasks"] = dict(zip(args.tasks, task_results, strict=True))
    print_table(results)
    print_geometry(results)
    suffix = "_quick" if args.quick else ""
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"ablation_learning{suffix}.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, args.out / f"ablation_learning{suffix}.png")
    print(f"wrote {args.out / f'ablation_learning{suffix}.json'} and the plot beside it")


if __name__ == "__main__":
    main()
