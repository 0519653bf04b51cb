"""`ToolEnv` (envs/base.py), the registry (envs/__init__.py) and the scripted policy (envs/policy.py), over every
registered environment and a small custom env."""

from __future__ import annotations

import subprocess
import sys
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.error import ResetNeeded
from gymnasium.utils.env_checker import check_env
from pydantic import ValidationError

from longstraw_agents.envs import (
    ENV_IDS,
    CalculatorEnv,
    ScriptedPolicy,
    ToolEnv,
    registered_env_ids,
    run_episode,
)
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.tools import ToolResult, format_tool_call

ALL_IDS = list(ENV_IDS)
TOKENIZER = load_tokenizer()
EOS = TOKENIZER.eos_token_id


def encode_turn(text: str) -> np.ndarray:
    """An assistant turn as a policy would emit it (special tokens allowed, ending with <|im_end|>)."""
    return np.array(TOKENIZER.encode(text + "<|im_end|>", allow_special=True))


def make_calculator(**kwargs) -> gymnasium.Env:
    return gymnasium.make("LongStraw/Calculator-v0", num_operations=1, max_operand=9, word_problems=False, **kwargs)


class EchoEnv(ToolEnv[str]):
    """No tools: answer with the word the user gives."""

    def make_task(self, rng: np.random.Generator) -> str:
        return ["alpha", "beta", "gamma"][int(rng.integers(3))]

    def user_prompt(self, task: str) -> str:
        return f"Say {task}."

    def score(self, task: str, answer: str) -> float:
        return float(answer == task)


# ------------------------------------------------------------------------------------------------------------------
# Registration and the Gymnasium contract
# ------------------------------------------------------------------------------------------------------------------


def test_every_env_is_registered_under_the_longstraw_namespace() -> None:
    assert set(ALL_IDS) <= set(registered_env_ids())
    assert all(env_id.startswith("LongStraw/") for env_id in registered_env_ids())


@pytest.mark.parametrize("env_id", ALL_IDS)
def test_check_env_passes_without_warnings(env_id: str) -> None:
    env = gymnasium.make(env_id)  # no arguments needed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env.unwrapped)
    env.close()


# PageRecall's task is in its pages, which the agent reads with a tool: every task's prompt is the same
SAME_PROMPT_FOR_EVERY_TASK = {"LongStraw/PageRecall-v0"}


@pytest.mark.parametrize("env_id", ALL_IDS)
def test_reset_is_deterministic_by_seed_and_records_it(env_id: str) -> None:
    env = gymnasium.make(env_id)
    first, info = env.reset(seed=7)
    again, _ = env.reset(seed=7)
    np.testing.assert_array_equal(first, again)
    assert env.unwrapped.trajectory.seed == 7 and info["seed"] == 7
    if env_id not in SAME_PROMPT_FOR_EVERY_TASK:
        assert any(not np.array_equal(first, env.reset(seed=seed)[0]) for seed in range(8, 12))
    unseeded, info = env.reset()  # the drawn episode seed is recorded and reproduces the episode
    np.testing.assert_array_equal(env.reset(seed=info["seed"])[0], unseeded)
    assert first.dtype == np.int64 and first.ndim == 1


@pytest.mark.parametrize("env_id", ALL_IDS)
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_scripted_policy_solves_every_seed(env_id: str, seed: int) -> None:
    env = gymnasium.make(env_id)
    trajectory = run_episode(env, ScriptedPolicy(env), seed=seed)
    assert trajectory.reward == 1.0
    assert trajectory.finish_reason == "answered"
    assert trajectory.env_id == env_id and trajectory.seed == seed
    roles = [segment.role for segment in trajectory]
    assert roles[:2] == ["system", "user"] and roles[-1] == "assistant"


@pytest.mark.parametrize("env_id", ALL_IDS)
def test_trajectory_is_exactly_the_concatenation_of_observations_and_actions(env_id: str) -> None:
    env = gymnasium.make(env_id)
    policy = ScriptedPolicy(env)
    observation, _ = env.reset(seed=5)
    exchanged = [observation]
    done = False
    while not done:
        action = policy(observation)
        observation, _, terminated, truncated, _ = env.step(action)
        exchanged += [action, observation]
        done = terminated or truncated
    trajectory = env.unwrapped.trajectory
    assert len(exchanged[-1]) == 0  # the observation that ends an episode is empty
    np.testing.assert_array_equal(trajectory.token_ids(), np.concatenate(exchanged))
    actions = [segment.token_ids for segment in trajectory if segment.role == "assistant"]
    for sent, recorded in zip(exchanged[1::2], actions, strict=True):
        np.testing.assert_array_equal(sent, recorded)
    # loss on exactly the action tokens; the segment texts decode the ids
    rendered = trajectory.render()
    assert rendered.loss_mask.sum() == sum(len(a) for a in actions)
    assert all(segment.text == TOKENIZER.decode(segment.token_ids) for segment in trajectory)


# ------------------------------------------------------------------------------------------------------------------
# Whatever the policy writes, the episode goes on
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("env_id", ALL_IDS)
def test_random_token_actions_get_error_observations_and_end_on_the_turn_budget(env_id: str) -> None:
    env = gymnasium.make(env_id)
    rng = np.random.default_rng(0)
    finish_reasons = set()
    for episode in range(6):
        env.reset(seed=episode)
        done = False
        while not done:
            action = rng.integers(0, TOKENIZER.vocab_size, size=int(rng.integers(0, 40)))
            observation, reward, terminated, truncated, info = env.step(action)
            done = terminated or truncated
            if not done:
                assert len(observation) > 0
                if not info["tool_calls"]:
                    assert "Error:" in info["observation_text"]
            assert isinstance(reward, float)
        finish_reasons.add(info["finish_reason"])
        trajectory = env.unwrapped.trajectory
        assert trajectory.finish_reason == info["finish_reason"] and trajectory.reward is not None
    assert "max_turns" in finish_reasons
    assert finish_reasons <= {"max_turns", "max_tokens", "answered"}


def test_a_turn_without_call_or_answer_gets_a_user_correction() -> None:
    env = make_calculator()
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(encode_turn("I think it is big."))
    assert (reward, terminated, truncated) == (0.0, False, False)
    segment = env.unwrapped.trajectory.segments[-1]
    assert segment.role == "user" and "neither a tool call nor an answer" in segment.text
    assert info["observation_text"] == TOKENIZER.decode(observation)
    _, _, _, _, info = env.step(encode_turn("<answer>12"))
    assert "missing its closing </answer>" in info["observation_text"]


def test_malformed_unknown_and_several_tool_calls_become_results_in_one_tool_message() -> None:
    env = make_calculator()
    env.reset(seed=0)
    turn = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>'
        + format_tool_call("teleport", {})
        + format_tool_call("calculator", {"expression": "2 + 3"})
        + format_tool_call("calculator", {"expression": "1 / 0"})
    )
    observation, _, terminated, truncated, info = env.step(encode_turn(turn))
    assert not (terminated or truncated)
    results = [ToolResult.model_validate(record) for record in info["tool_results"]]
    assert [r.error for r in results] == ["parse", "unknown_tool", None, "exception"]
    assert results[2].content == "5" and "division by zero" in results[3].content
    assert len(info["tool_calls"]) == 4 and info["tool_calls"][2]["arguments"] == {"expression": "2 + 3"}
    text = TOKENIZER.decode(observation)
    assert text.startswith("\n<|im_start|>tool\n") and text.count("<tool_response>") == 4
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    trajectory = env.unwrapped.trajectory
    assert trajectory.segments[-2].tool_calls == info["tool_calls"]  # the assistant segment records the calls
    assert [r["content"] for r in trajectory.segments[-1].tool_calls] == [r.content for r in results]


def test_an_answer_ends_the_episode_with_its_score_even_next_to_a_tool_call() -> None:
    env = make_calculator()
    env.reset(seed=0)
    task = env.unwrapped.task
    turn = format_tool_call("calculator", {"expression": task.expression}) + f"<answer>{task.answer}</answer>"
    observation, reward, terminated, truncated, info = env.step(encode_turn(turn))
    assert (reward, terminated, truncated, len(observation)) == (1.0, True, False, 0)
    assert info["answer"] == str(task.answer) and info["tool_results"] == []  # the call was not run
    assert env.unwrapped.trajectory.info["answer"] == str(task.answer)


def test_a_turn_cut_before_its_stop_token_is_closed_by_the_next_observation() -> None:
    env = make_calculator()
    env.reset(seed=0)
    cut = encode_turn(format_tool_call("calculator", {"expression": "1 + 1"}))[:-1]
    observation, *_ = env.step(cut)
    assert observation[0] == EOS
    assert TOKENIZER.decode(observation).startswith("<|im_end|>\n<|im_start|>tool\n")
    segment = env.unwrapped.trajectory.segments[-1]
    assert segment.role == "tool" and not segment.loss_mask.any()


# ------------------------------------------------------------------------------------------------------------------
# Budgets and episode end
# ------------------------------------------------------------------------------------------------------------------


def test_turn_budget_truncates_and_is_recorded() -> None:
    env = make_calculator(max_turns=2)
    env.reset(seed=0)
    call = encode_turn(format_tool_call("calculator", {"expression": "1 + 1"}))
    assert env.step(call)[3] is False
    observation, reward, terminated, truncated, info = env.step(call)
    assert (reward, terminated, truncated, len(observation)) == (0.0, False, True, 0)
    assert info["finish_reason"] == "max_turns" and info["tool_results"] == []  # the last turn's calls do not run
    trajectory = env.unwrapped.trajectory
    assert (trajectory.finish_reason, trajectory.reward) == ("max_turns", 0.0)
    assert [s.role for s in trajectory][-1] == "assistant"


def test_token_budget_truncates_before_an_observation_that_does_not_fit() -> None:
    probe = make_calculator()
    prompt, _ = probe.reset(seed=0)
    call = encode_turn(format_tool_call("calculator", {"expression": "1 + 1"}))
    env = make_calculator(max_tokens=len(prompt) + len(call) + 5)
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(call)
    assert (reward, terminated, truncated, len(observation)) == (0.0, False, True, 0)
    assert info["finish_reason"] == "max_tokens" and info["tool_results"][0]["content"] == "2"
    trajectory = env.unwrapped.trajectory
    assert trajectory.finish_reason == "max_tokens" and trajectory.num_tokens == len(prompt) + len(call)


def test_an_answer_in_a_turn_past_the_token_budget_is_not_scored() -> None:
    probe = make_calculator()
    prompt, _ = probe.reset(seed=0)
    answer = encode_turn(f"<answer>{probe.unwrapped.task.answer}</answer>")
    env = make_calculator(max_tokens=len(prompt) + len(answer) - 1)
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(answer)
    assert (reward, terminated, truncated, len(observation)) == (0.0, False, True, 0)
    assert info["finish_reason"] == "max_tokens"
    assert env.unwrapped.trajectory.num_tokens == len(prompt) + len(answer)  # the action is kept, and flagged
    env = make_calculator(max_tokens=len(prompt) + len(answer))  # exactly at the budget: scored
    env.reset(seed=0)
    assert env.step(answer)[1:4] == (1.0, True, False)


@pytest.mark.parametrize("env_id", ["LongStraw/Calculator-v0", "LongStraw/NeedleSearch-v0"])
def test_an_answer_with_more_digits_than_python_converts_scores_zero(env_id: str) -> None:
    env = gymnasium.make(env_id, max_tokens=200_000)
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(encode_turn(f"<answer>{'9' * 5000}</answer>"))
    assert (reward, terminated, truncated) == (0.0, True, False)


def test_a_prompt_longer_than_the_token_budget_is_a_clear_error() -> None:
    env = make_calculator(max_tokens=10)
    with pytest.raises(ValueError, match="raise max_tokens"):
        env.reset(seed=0)
    with pytest.raises(ResetNeeded):  # no half-built episode is left behind
        env.unwrapped.step(encode_turn("<answer>1</answer>"))


def test_stepping_after_the_end_or_before_reset_raises_reset_needed() -> None:
    env = make_calculator().unwrapped  # without gymnasium's order-enforcing wrapper: the env's own check
    with pytest.raises(ResetNeeded, match="call reset"):
        env.step(encode_turn("<answer>1</answer>"))
    env.reset(seed=0)
    env.step(encode_turn("<answer>1</answer>"))
    with pytest.raises(ResetNeeded, match=r"ended \(answered\)"):
        env.step(encode_turn("<answer>1</answer>"))
    env.reset(seed=0)
    assert env.turn == 0 and not env.done


# ------------------------------------------------------------------------------------------------------------------
# Actions: logprobs, and what is outside the action space
# ------------------------------------------------------------------------------------------------------------------


def test_behaviour_logprobs_via_record_logprobs_or_a_dict_action() -> None:
    env = make_calculator()
    env.reset(seed=0)
    call = encode_turn(format_tool_call("calculator", {"expression": "1 + 1"}))
    lp = -np.linspace(0.1, 1.0, len(call))
    env.unwrapped.record_logprobs(lp)
    env.step(call)
    env.step({"token_ids": call, "logprobs": 2 * lp})
    assistant = [s for s in env.unwrapped.trajectory if s.role == "assistant"]
    np.testing.assert_allclose(assistant[0].logprobs, lp.astype(np.float32))
    np.testing.assert_allclose(assistant[1].logprobs, (2 * lp).astype(np.float32))
    rendered = env.unwrapped.trajectory.render()
    assert np.isnan(rendered.logprobs[~rendered.loss_mask]).all()


@pytest.mark.parametrize(
    ("action", "error", "match"),
    [
        (np.array([1, 2, TOKENIZER.vocab_size]), ValueError, "outside the action space"),
        (np.array([-1]), ValueError, "outside the action space"),
        (np.zeros((2, 2), dtype=np.int64), ValueError, "1-D"),
        (np.array([0.5, 1.5]), TypeError, "integer token ids"),
        ({"ids": [1, 2]}, ValueError, '"token_ids"'),
        ({"token_ids": [1, 2], "logprobs": [0.0]}, ValueError, "1 logprobs for an action of 2 tokens"),
    ],
)
def test_actions_outside_the_action_space_raise_and_leave_the_episode_intact(action, error, match) -> None:
    env = make_calculator()
    prompt, _ = env.reset(seed=0)
    with pytest.raises(error, match=match):
        env.step(action)
    unwrapped = env.unwrapped
    assert unwrapped.turn == 0 and unwrapped.num_tokens == len(prompt)
    assert env.step(encode_turn("<answer>1</answer>"))[2] is True  # the episode is still usable


def test_logprobs_given_twice_are_refused() -> None:
    env = make_calculator()
    env.reset(seed=0)
    env.unwrapped.record_logprobs([0.0, 0.0])
    with pytest.raises(ValueError, match="given twice"):
        env.step({"token_ids": [1, EOS], "logprobs": [0.0, 0.0]})


# ------------------------------------------------------------------------------------------------------------------
# Info, options, configuration, rendering
# ------------------------------------------------------------------------------------------------------------------


def test_info_carries_text_and_tool_records() -> None:
    env = make_calculator()
    prompt, info = env.reset(seed=0)
    assert info["text"] == TOKENIZER.decode(prompt) and info["tools"] == ["calculator"]
    assert info["finish_reason"] == "running" and info["num_tokens"] == len(prompt)
    call = encode_turn(format_tool_call("calculator", {"expression": "6 * 7"}))
    observation, _, _, _, info = env.step(call)
    assert info["text"] == TOKENIZER.decode(call) and info["turn"] == 0
    assert info["observation_text"] == TOKENIZER.decode(observation)
    assert info["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "6 * 7"}}]
    [result] = info["tool_results"]
    assert result["ok"] and result["content"] == "42" and result["name"] == "calculator"
    assert info["num_tokens"] == len(prompt) + len(call) + len(observation) and info["answer"] is None


def test_reset_options_set_group_and_policy_version() -> None:
    env = make_calculator()
    env.reset(seed=0, options={"group_id": "g-7", "policy_version": 3})
    trajectory = env.unwrapped.trajectory
    assert (trajectory.group_id, trajectory.policy_version) == ("g-7", 3)
    with pytest.raises(ValueError, match="unknown reset option"):
        env.reset(seed=0, options={"temperature": 1.0})


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValidationError, match="num_operatons"):
        gymnasium.make("LongStraw/Calculator-v0", num_operatons=2)
    with pytest.raises(ValidationError, match="max_turns"):
        gymnasium.make("LongStraw/PythonTask-v0", max_turns=0)
    with pytest.raises(ValueError, match="render_mode"):
        CalculatorEnv(render_mode="human")


def test_render_ansi_returns_the_episode_text() -> None:
    env = gymnasium.make("LongStraw/Calculator-v0", render_mode="ansi")
    prompt, _ = env.reset(seed=0)
    assert env.render() == TOKENIZER.decode(prompt)


def test_a_custom_env_needs_only_its_hooks() -> None:
    env = EchoEnv(max_turns=3)
    prompt, info = env.reset(seed=1)
    assert info["tools"] == [] and "Give the final answer as <answer>" in TOKENIZER.decode(prompt)
    _, _, _, _, info = env.step(encode_turn("hello"))
    assert "has no answer" in info["observation_text"]
    _, reward, terminated, _, _ = env.step(encode_turn(f"<answer>{env.task}</answer>"))
    assert (reward, terminated) == (1.0, True)
    assert env.trajectory.env_id == "EchoEnv"
    with pytest.raises(NotImplementedError, match="scripted_turns"):
        ScriptedPolicy(env).act()


def test_envs_import_without_torch_or_transformers() -> None:
    code = (
        "import sys, gymnasium, longstraw_agents.envs; "
        "gymnasium.make('LongStraw/Calculator-v0').reset(seed=0); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
