"""``make demo``: ``python -m longstraw_agents.demo --out runs/demo``.

For now the demo plays the scripted (oracle) policy for one episode of each LongStraw environment, stores the
episodes in ``OUT/trajectories.db`` (one run row per invocation, with the tokenizer's identity) and prints their
transcripts. Training on top of it comes with the rollout and trainer issues.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gymnasium

from longstraw_agents.envs import EASY_CALCULATOR_KWARGS, ScriptedPolicy, run_episode, unwrap_tool_env
from longstraw_agents.store import Store
from longstraw_agents.trajectory import Trajectory

STORE_NAME = "trajectories.db"
DEMO_ENVS: dict[str, dict[str, Any]] = {
    "LongStraw/Calculator-v0": dict(EASY_CALCULATOR_KWARGS),  # the setting the CPU training demo learns
    "LongStraw/NeedleSearch-v0": {"target_tokens": 4096},
    "LongStraw/PythonTask-v0": {},
}


@dataclass(frozen=True)
class ScriptedDemo:
    """What ``run_scripted_demo`` wrote: the store, the run, its episodes (by env id) and a readable report."""

    store_path: Path
    run_id: str
    episode_ids: dict[str, int]
    trajectories: dict[str, Trajectory]
    report: str


def run_scripted_demo(out_dir: str | Path, *, seed: int = 0, max_text: int = 160) -> ScriptedDemo:
    """One scripted episode of each env in `DEMO_ENVS`, stored as one run in ``out_dir/trajectories.db``."""
    store_path = Path(out_dir) / STORE_NAME
    trajectories: dict[str, Trajectory] = {}
    tokenizer_name = ""
    for env_id, kwargs in DEMO_ENVS.items():
        env = gymnasium.make(env_id, **kwargs)
        trajectories[env_id] = run_episode(env, ScriptedPolicy(env), seed=seed)
        tokenizer_name = unwrap_tool_env(env).tokenizer.name
        env.close()
    with Store.open(store_path) as store:
        run_id = store.add_run(
            config={"demo": "scripted", "seed": seed, "envs": DEMO_ENVS},
            model="scripted-policy",
            tokenizer=tokenizer_name,
            notes="one episode of each environment, played by its scripted reference policy",
        )
        episode_ids = dict(zip(trajectories, store.add_episodes(trajectories.values(), run_id=run_id), strict=True))
        report = store.summary_text(where="run_id = ?", params=[run_id], transcript=True, max_text=max_text)
    return ScriptedDemo(store_path, run_id, episode_ids, trajectories, report)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m longstraw_agents.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="output directory (default: runs/demo)")
    parser.add_argument("--seed", type=int, default=0, help="episode seed (default: 0)")
    parser.add_argument("--max-text", type=int, default=160, help="cut segment text to this many characters (0: never)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    demo = run_scripted_demo(args.out, seed=args.seed, max_text=args.max_text)
    print(demo.report)
    print()
    for env_id, trajectory in demo.trajectories.items():
        print(
            f"{env_id}: reward {trajectory.reward:.3f} ({trajectory.finish_reason}, {trajectory.num_tokens:,} tokens)"
        )
    print(f"stored run {demo.run_id} in {demo.store_path}; inspect it with: longstraw inspect {demo.store_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
