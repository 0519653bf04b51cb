"""Stores for the viewer's tests: a run directory whose group has a known tree (a shared prompt, a branch point
inside the first assistant turn, one inside the answer, a member that ends after a tool result), and a group of
million-token episodes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from longstraw_agents.app.records import EvalRecord, StepRecord, WarmStartRecord
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.trainer import StepMetrics
from longstraw_agents.trajectory import Segment, Trajectory

ENV_ID = "LongStraw/Calculator-v0"
TOOL_OUTPUT = "12 </script><b>not markup</b> 🦙"  # a result that must stay text on the page
RUN_CONFIG: dict[str, Any] = {"tokenizer": "longstraw-bpe", "trainer": {"loss": {"scale_rewards": True}}}


def _ids(text: str, special: bool = False) -> list[int]:
    return load_tokenizer().encode(text, allow_special=special)


def _assistant(text: str, turn: int, calls: list[dict[str, Any]] | None = None) -> Segment:
    ids = _ids(text, special=True)
    logprobs = -np.linspace(0.05, 3.0, len(ids))
    return Segment("assistant", ids, logprobs=logprobs, turn=turn, text=text, tool_calls=calls)


def _context(role: str, text: str, turn: int = 0, calls: list[dict[str, Any]] | None = None) -> Segment:
    return Segment(role, _ids(text, special=True), turn=turn, text=text, tool_calls=calls)  # type: ignore[arg-type]


CALL = {"name": "calculator", "arguments": {"expression": "7 + 5"}}
RESULT = {"name": "calculator", "ok": True, "content": TOOL_OUTPUT, "truncated": True, "original_length": 4096}


def calculator_group(group_id: str = "step2-g0", policy_version: int = 1) -> list[Trajectory]:
    """Four members: #0 calls the tool and answers 12 (reward 1), #1 calls it and answers 13, #2 answers 11 at once,
    #3 stops after the tool's result (max_turns); #0 and #1 diverge inside the answer."""
    prompt = [
        _context("system", "<|im_start|>system\nAnswer with the calculator.<|im_end|>\n"),
        _context("user", "<|im_start|>user\nWhat is 7 + 5?<|im_end|>\n<|im_start|>assistant\n"),
    ]
    call = _assistant('<tool_call>{"name": "calculator", "arguments": {"expression": "7 + 5"}}</tool_call>', 0, [CALL])
    result = _context("tool", f"<|im_start|>tool\n{TOOL_OUTPUT}<|im_end|>\n<|im_start|>assistant\n", 0, [RESULT])

    def member(segments: list[Segment], reward: float, finish: str) -> Trajectory:
        return Trajectory(list(segments), ENV_ID, group_id, 5, reward, finish, policy_version)  # type: ignore[arg-type]

    return [
        member([*prompt, call, result, _assistant("<answer>12</answer><|im_end|>", 1)], 1.0, "answered"),
        member([*prompt, call, result, _assistant("<answer>13</answer><|im_end|>", 1)], 0.0, "answered"),
        member([*prompt, _assistant("<answer>11</answer><|im_end|>", 0)], 0.0, "answered"),
        member([*prompt, call, result], 0.0, "max_turns"),
    ]


def step_metrics(step: int, reward: float, loss: float, kl: float | None) -> StepRecord:
    metrics = StepMetrics(
        step=step, policy_version=step, mode="exact", loss=loss, reward_mean=reward, reward_std=0.5, grad_norm=0.5,
        lr=1e-3, loss_tokens=40, unique_tokens=60, sequence_tokens=75, forward_tokens=90, seconds=1.5, peak_bytes=None,
        kl=kl,
    )  # fmt: skip
    return StepRecord(metrics=metrics, episode_tokens_mean=120.5)


def write_run_directory(directory: Path) -> Path:
    """A run directory as ``longstraw train`` leaves it: a scripted run (one episode played alone), then the
    training run (config.json is its config) with groups step1-g0 and step2-g0, and metrics.jsonl for 2 steps."""
    directory.mkdir(parents=True, exist_ok=True)
    with Store.open(directory / "trajectories.db") as store:
        scripted = store.add_run(config={"demo": "scripted"}, model="scripted-policy", tokenizer="longstraw-bpe-v1")
        store.add_episode(calculator_group(group_id="")[0], run_id=scripted)
        run = store.add_run(config=RUN_CONFIG, model="preset:llama", tokenizer="longstraw-bpe-v1")
        store.add_episodes(calculator_group("step1-g0", 0)[1:3], run_id=run)
        store.add_episodes(calculator_group(), run_id=run)
    (directory / "config.json").write_text(json.dumps(RUN_CONFIG))
    lines = [
        WarmStartRecord(episodes=8, steps=2, loss_first=3.0, loss_last=2.0, seconds=1.0),
        EvalRecord(step=0, reward_mean=0.25, episodes=4, policy_version=0),
        step_metrics(1, 0.0, 0.01, 0.0),
        step_metrics(2, 0.25, -0.02, 0.003),
        EvalRecord(step=2, reward_mean=0.5, episodes=4, policy_version=2),
    ]
    (directory / "metrics.jsonl").write_text("".join(line.to_json() + "\n" for line in lines) + '{"partial": ')
    return directory


def long_group(prefix_tokens: int, members: int = 4, seed: int = 0) -> list[Trajectory]:
    """A group sharing ``prefix_tokens`` of context (a system prompt, a question, one long tool output) and then
    diverging at once into short turns of their own; ids are random tokens of the shipped vocabulary."""
    rng = np.random.default_rng(seed)
    vocab = 2048

    def tokens(count: int) -> np.ndarray:
        return rng.integers(0, vocab, size=count)

    system, user = tokens(1000), tokens(100)
    tool = tokens(prefix_tokens - len(system) - len(user))
    shared = [
        Segment("system", system),
        Segment("user", user),
        Segment("tool", tool, tool_calls=[{"name": "read", "ok": True, "content": "x" * 100_000}]),
    ]
    group = []
    for k in range(members):
        own = tokens(50)
        own[0] = k  # a distinct first token: every member diverges right after the shared prefix
        turn = [
            Segment("assistant", own, logprobs=-rng.exponential(size=50), turn=1),
            Segment("tool", tokens(200), turn=1),
            Segment("assistant", tokens(20), logprobs=-rng.exponential(size=20), turn=2),
        ]
        group.append(Trajectory(shared + turn, ENV_ID, "step1-g0", seed, float(k % 2), "max_tokens", 0))
    return group
