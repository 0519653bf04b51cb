"""Where every seed of a run comes from: one function per stream of random draws, each a pure function of the run's
seed and its indices, so that a run — and a run resumed after a kill, which replays the interrupted step — draws
the same tasks and the same tokens. No global random state is touched: samplers get their own generators.

The streams are kept apart by disjoint integer ranges (numbers chosen once and kept, since changing them changes
every run's tasks):

- training tasks: ``(seed + 1) · 1,000,003 + step · 1,009 + group`` — the prime stride keeps the task seeds of runs
  with nearby seeds apart; ``group < 1,009`` (``groups_per_step`` is checked against it) keeps steps apart;
- per-step sampling: ``seed · 100,003 + step`` (the sampler derives one seed per request from it), plus
  ``dp_rank · 2**40`` for the data-parallel ranks after the first (each rolls out other tasks and must not replay
  the first rank's random draws; rank 0 draws as a one-process run);
- warm-start traces: ``10,000,000 + episode``, the same for every run (a fixed supervised data set);
- warm-start drills: one generator per stage, seeded ``[20,000,000, stage]``, the same for every run;
- held-out evaluation: ``900,000,000 + episode`` tasks, sampled with seed 900,000,000 — above every training task
  seed of runs with seed < 899, and the same for every run and step, so evaluations compare like with like.
"""

from __future__ import annotations

TASK_RUN_STRIDE = 1_000_003
TASK_STEP_STRIDE = 1_009
SAMPLING_RUN_STRIDE = 100_003
SAMPLING_RANK_STRIDE = 2**40
WARM_START_BASE = 10_000_000
DRILL_BASE = 20_000_000
EVAL_BASE = 900_000_000


def task_seed(run_seed: int, step: int, group: int) -> int:
    """The environment seed of group ``group`` of training step ``step``."""
    if not 0 <= group < TASK_STEP_STRIDE:
        raise ValueError(f"group index {group} outside [0, {TASK_STEP_STRIDE}): task seeds of steps would overlap")
    return (run_seed + 1) * TASK_RUN_STRIDE + step * TASK_STEP_STRIDE + group


def sampling_seed(run_seed: int, step: int, dp_rank: int = 0) -> int:
    """The seed of the sampler that rolls out training step ``step`` on data-parallel rank ``dp_rank``."""
    return run_seed * SAMPLING_RUN_STRIDE + step + dp_rank * SAMPLING_RANK_STRIDE


def warm_start_seed(episode: int) -> int:
    """The environment seed of scripted warm-start episode ``episode``."""
    return WARM_START_BASE + episode


def drill_seed(stage: int) -> list[int]:
    """The generator seed of the warm start's drill stage ``stage`` (the stage after the last drill stage: the
    drills rehearsed among the episodes)."""
    return [DRILL_BASE, stage]


def eval_sampling_seed(dp_rank: int = 0) -> int:
    """The seed of the sampler that plays the held-out episodes on data-parallel rank ``dp_rank``."""
    return EVAL_BASE + dp_rank * SAMPLING_RANK_STRIDE


def eval_task_seed(episode: int) -> int:
    """The environment seed of held-out episode ``episode``."""
    return EVAL_BASE + episode


EVAL_SAMPLING_SEED = EVAL_BASE
