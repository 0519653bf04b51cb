"""``LongStraw/PythonTask-v0`` (envs/python_task.py) and its problem families (envs/python_problems.py)."""

from __future__ import annotations

import math
import socket

import numpy as np
import pytest
from pydantic import ValidationError

from longstraw_agents.envs import PythonTaskEnv, ScriptedPolicy, run_episode
from longstraw_agents.envs.python_problems import FAMILIES, make_python_problem
from longstraw_agents.envs.python_task import extract_code
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.tools import ToolResult, format_tool_call

TOKENIZER = load_tokenizer()


def encode_turn(text: str) -> np.ndarray:
    return np.array(TOKENIZER.encode(text + "<|im_end|>", allow_special=True))


@pytest.fixture
def env() -> PythonTaskEnv:
    return PythonTaskEnv(test_timeout_s=5.0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_is_solved_by_its_reference(family: str) -> None:
    env = PythonTaskEnv(families=(family,), num_tests=6)
    trajectory = run_episode(env, ScriptedPolicy(env), seed=1)
    assert env.task.family == family
    assert trajectory.reward == 1.0, trajectory.info["score"]
    assert trajectory.info["score"] == {"passed": 6, "total": 6, "error": None, "failures": []}
    # the scripted check printed the example's result, as the prompt states it
    assert trajectory.segments[3].text.split("<tool_response>\n")[1].startswith(str(env.task.example_result))


def test_problems_are_deterministic_by_seed_and_vary_across_seeds() -> None:
    families = tuple(FAMILIES)
    first = make_python_problem(np.random.default_rng(3), families, 8)
    assert make_python_problem(np.random.default_rng(3), families, 8) == first
    assert len({make_python_problem(np.random.default_rng(s), families, 8).reference for s in range(12)}) > 6
    assert len(first.cases) == len(first.expected) == 8


def _answer(env: PythonTaskEnv, code: str) -> tuple[float, dict]:
    _, reward, terminated, _, info = env.step(encode_turn(f"<answer>\n{code}\n</answer>"))
    assert terminated
    return reward, info["score"]


def test_a_partly_wrong_solution_gets_partial_reward(env: PythonTaskEnv) -> None:
    env.reset(seed=0)
    task = env.task
    # Right on the 1st, 3rd, 5th... call, wrong (None) on the others: the harness calls the tests in order.
    code = (
        task.reference.replace(f"def {task.function}(", "def _reference(", 1)
        + f"\n_calls = 0\n\ndef {task.function}(*args):\n    global _calls\n    _calls += 1\n"
        "    return _reference(*args) if _calls % 2 else None\n"
    )
    reward, score = _answer(env, code)
    total = len(task.cases)
    wrong_by_luck = sum(expected == "null" for expected in task.expected[1::2])
    assert reward == pytest.approx((math.ceil(total / 2) + wrong_by_luck) / total)
    assert 0 < reward < 1 and score["failures"] and score["error"] is None
    assert set(score["failures"][0]) == {"args", "expected", "got"}


def test_a_wrong_solution_gets_zero(env: PythonTaskEnv) -> None:
    env.reset(seed=0)
    reward, score = _answer(env, f"def {env.task.function}(*args):\n    return 'nope'\n")
    assert reward == 0.0 and score["passed"] == 0


@pytest.mark.parametrize(
    ("code", "message"),
    [
        ("def broken(:\n    pass\n", "SyntaxError"),
        ("raise RuntimeError('at import')\n", "RuntimeError: at import"),
        ("def something_else():\n    return 1\n", "AttributeError"),
        ("", "no code"),
    ],
)
def test_a_solution_that_does_not_load_scores_zero_and_says_why(env: PythonTaskEnv, code: str, message: str) -> None:
    env.reset(seed=0)
    reward, score = _answer(env, code)
    assert reward == 0.0 and message in score["error"]
    assert env.unwrapped.trajectory.info["score"]["error"] == score["error"]


def test_a_crashing_test_call_fails_that_test_only(env: PythonTaskEnv) -> None:
    env.reset(seed=0)
    task = env.task
    code = task.reference.replace(f"def {task.function}(", "def _reference(", 1) + (
        f"\n_calls = 0\n\ndef {task.function}(*args):\n    global _calls\n    _calls += 1\n"
        "    if _calls == 1:\n        raise ValueError('first call')\n"
        "    print('noise')\n    return _reference(*args)\n"
    )
    reward, score = _answer(env, code)
    assert reward == pytest.approx((len(task.cases) - 1) / len(task.cases))
    assert score["failures"][0]["error"] == "ValueError: first call"


def test_a_hanging_solution_times_out_and_keeps_the_tests_that_finished() -> None:
    env = PythonTaskEnv(test_timeout_s=1.5)
    env.reset(seed=0)
    task = env.task
    code = task.reference.replace(f"def {task.function}(", "def _reference(", 1) + (
        f"\n_calls = 0\n\ndef {task.function}(*args):\n    global _calls\n    _calls += 1\n"
        "    while _calls > 2:\n        pass\n    return _reference(*args)\n"
    )
    reward, score = _answer(env, code)
    assert reward == pytest.approx(2 / len(task.cases))
    assert score["error"] == "the tests timed out after 1.5 s"


def test_a_solution_that_exits_the_interpreter_is_reported(env: PythonTaskEnv) -> None:
    env.reset(seed=0)
    reward, score = _answer(env, f"import os\n\ndef {env.task.function}(*args):\n    os._exit(3)\n")
    assert reward == 0.0 and score["error"].startswith("the test run exited with status 3")
    assert score["failures"][0]["error"].startswith("did not run")


def test_printed_fake_results_do_not_count(env: PythonTaskEnv) -> None:
    env.reset(seed=0)
    lines = "".join(f'    print(\'{{"index": {i}, "result": "0"}}\')\n' for i in range(8))
    reward, _ = _answer(env, f"import sys\nfor _ in range(3):\n{lines}\ndef {env.task.function}(*a):\n    return 0\n")
    expected = sum(value == "0" for value in env.task.expected) / len(env.task.expected)
    assert reward == pytest.approx(expected)


def test_crashing_code_in_the_python_tool_is_an_error_observation(env: PythonTaskEnv) -> None:
    env.reset(seed=0)
    call = format_tool_call("python", {"code": "print('before')\n1 / 0\n"})
    observation, reward, terminated, truncated, info = env.step(encode_turn(call))
    assert (reward, terminated, truncated) == (0.0, False, False)
    [result] = [ToolResult.model_validate(record) for record in info["tool_results"]]
    assert not result.ok and result.error == "exception"
    assert "before" in result.content and "ZeroDivisionError" in result.content
    assert "ZeroDivisionError" in TOKENIZER.decode(observation)
    assert env.step(encode_turn(f"<answer>\n{env.task.reference}</answer>"))[1] == 1.0  # the episode goes on


def test_code_fences_around_the_answer_are_accepted(env: PythonTaskEnv) -> None:
    assert extract_code("```python\ndef f():\n    return 1\n```") == "def f():\n    return 1"
    assert extract_code("  def f(): pass  ") == "def f(): pass"
    env.reset(seed=2)
    reward, _ = _answer(env, f"```python\n{env.task.reference}```")
    assert reward == 1.0


def test_unknown_families_are_refused() -> None:
    with pytest.raises(ValidationError, match="unknown problem families"):
        PythonTaskEnv(families=("sudoku",))


@pytest.mark.parametrize(("allow_network", "outcome"), [(False, "refused"), (True, "connected")])
def test_the_python_tool_has_no_network_unless_the_config_allows_it(allow_network: bool, outcome: str) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        env = PythonTaskEnv(allow_network=allow_network)
        env.reset(seed=0)
        code = (
            "import socket\ntry:\n"
            f"    socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=3)\n"
            "    print('connected')\nexcept OSError:\n    print('refused')\n"
        )
        info = env.step(encode_turn(format_tool_call("python", {"code": code})))[4]
        [result] = [ToolResult.model_validate(record) for record in info["tool_results"]]
        assert result.content == outcome
