"""``LongStraw/PageRecall-v0`` (envs/page_recall.py): the long-horizon task that only summaries can solve."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest

from longstraw_agents.envs import PageRecallConfig, PageRecallEnv, ScriptedPolicy, run_episode, unwrap_tool_env
from longstraw_agents.envs.key_value import word_pools
from longstraw_agents.envs.page_recall import NO_PAGE_LEFT
from longstraw_agents.tools import format_tool_call, parse_tool_calls

SUMMARY_4K = {"max_context_tokens": 4096, "strategy": {"kind": "summary", "threshold": 2560}}


def code_token(env: PageRecallEnv) -> int:
    [token] = env.tokenizer.encode(env.task.code)
    return token


def test_the_scripted_solution_reads_32k_tokens_through_4k_contexts_and_answers() -> None:
    for seed in range(3):
        env = PageRecallEnv(context=SUMMARY_4K)
        trajectory = run_episode(env, ScriptedPolicy(env), seed=seed)
        assert trajectory.reward == 1.0 and trajectory.finish_reason == "answered"
        assert trajectory.num_tokens >= 32_768
        sequences = trajectory.physical_sequences()
        assert len(sequences) == env.config.pages + 1  # a summary after every page
        assert max(trajectory.num_tokens_of(list(s.segments)) for s in sequences) <= 4096
        assert env.context_replies == env.config.pages


def test_after_page_one_the_code_lives_only_in_the_summaries() -> None:
    """The code's token is in page 1 and nowhere else the environment wrote: past the first summary, only what
    the policy wrote carries it."""
    env = PageRecallEnv(context=SUMMARY_4K)
    trajectory = run_episode(env, ScriptedPolicy(env), seed=4)
    code = code_token(env)
    holders = [s for s in trajectory.segments if code in s.token_ids.tolist()]
    assert holders[0].role == "tool" and holders[0].text.count(env.task.code_line) == 1
    assert {s.role for s in holders[1:]} == {"assistant"}
    assert len(holders) == 1 + env.config.pages + 1  # page 1, every summary, the answer


def test_a_summary_that_drops_the_code_loses_it_for_good() -> None:
    """Play the script but write summaries without the code: no context after the first holds the code's token,
    and the best the policy can then do is guess."""
    env = PageRecallEnv(context=SUMMARY_4K, pages=3)
    script = ScriptedPolicy(env)
    observation, _ = env.reset(seed=1)
    code = code_token(env)
    while not env.awaiting_context_reply:
        observation, *_ = env.step(script(observation))
    forgot = len(env.trajectory.segments)
    guess = next(v for v in word_pools(env.tokenizer).values if v != env.task.code)
    while not env.done:
        if env.awaiting_context_reply:
            text = "I read a page."
        elif NO_PAGE_LEFT in env.trajectory.segments[-1].text:
            text = f"<answer>{guess}</answer>"
        else:
            text = format_tool_call("read_page", {})
        observation, *_ = env.step(env.formatter.assistant(text, env.turn).token_ids)
    assert all(code not in s.token_ids.tolist() for s in env.trajectory.segments[forgot:])
    assert env.trajectory.finish_reason == "answered"


def test_reading_past_the_last_page_says_none_is_left() -> None:
    env = PageRecallEnv(pages=2, page_tokens=100)
    env.reset(seed=0)
    [call] = parse_tool_calls(format_tool_call("read_page", {}))
    outputs = [env.registry.call(call).content for _ in range(3)]
    assert outputs[0].startswith("Page 1 of 2.") and env.task.code_line in outputs[0]
    assert outputs[1].startswith("Page 2 of 2.") and env.task.code_line not in outputs[1]
    assert outputs[2] == NO_PAGE_LEFT


def test_tasks_follow_the_seed_and_budgets_follow_the_pages() -> None:
    first, second = PageRecallEnv(), PageRecallEnv()
    first.reset(seed=7)
    second.reset(seed=7)
    assert first.task == second.task
    config = PageRecallConfig(pages=5, page_tokens=1000)
    assert (config.max_turns, config.max_tokens) == (14, 5 * 1256 + 4096)
    assert PageRecallConfig(pages=5, max_turns=3).max_turns == 3
    with pytest.raises(ValueError):
        PageRecallConfig(pages=0)


def test_registered_with_gymnasium() -> None:
    env = gymnasium.make("LongStraw/PageRecall-v0", pages=2, page_tokens=200)
    observation, _ = env.reset(seed=0)
    assert isinstance(unwrap_tool_env(env), PageRecallEnv) and isinstance(observation, np.ndarray)


def test_no_code_word_is_in_a_text_of_the_environments_own() -> None:
    """The prompts, the summary request and the script's calls hold none of the words a code is drawn from (the
    first 8 of the value pool were ' in', ' at', ' st', ' then'...: a copy could not tell the code from the prompt)."""
    env = PageRecallEnv(context={**SUMMARY_4K, "strategy": {"kind": "summary", "request": "Summarise the code."}})
    trajectory = run_episode(env, ScriptedPolicy(env), seed=0)
    words = env.code_words()
    assert len(words) >= 32
    codes = {token for word in words for token in env.tokenizer.encode(word)}
    assert len(codes) == len(words)
    written = [s for s in trajectory.segments if s.role in ("system", "user")]
    assert not codes & {int(t) for s in written for t in s.token_ids}
    few = PageRecallEnv(codes=4)
    drawn = set()
    for seed in range(40):
        few.reset(seed=seed)
        drawn.add(few.task.code)
    assert drawn == set(few.code_words()[:4])


def test_an_answer_before_the_last_page_scores_nothing() -> None:
    """The right code after page 1 scores 0: the task is carrying it through every page (the scripted solution,
    which reads them all, scores 1 above)."""
    env = PageRecallEnv(context=SUMMARY_4K, pages=3)
    script = ScriptedPolicy(env)
    observation, _ = env.reset(seed=2)
    while not env.awaiting_context_reply:
        observation, *_ = env.step(script(observation))
    observation, *_ = env.step(script(observation))  # the summary, with the code
    answer = env.formatter.assistant(f"<answer>{env.task.code}</answer>", env.turn).token_ids
    _, reward, terminated, _, _ = env.step(answer)
    assert terminated and reward == 0.0 and env.trajectory.info["score"] == {"read_all_pages": False}


def test_a_drill_document_states_a_code_on_a_page_then_copies_it_with_loss_on_the_copy_alone() -> None:
    env = PageRecallEnv(codes=4)
    codes = {env.tokenizer.encode(w)[0] for w in env.code_words()[:4]}
    drawn = set()
    for tokens in (20, 300, 3000):
        rng = np.random.default_rng(tokens)
        document = env.drill_document(rng, tokens)
        page, copy = document.segments
        assert page.role == "user" and copy.role == "assistant"
        assert tokens * 0.7 <= document.num_tokens <= tokens * 1.3 + 20  # about the length asked for
        [code] = [t for t in page.token_ids.tolist() if t in codes]  # the code, once, among the filler
        assert copy.token_ids.tolist() == env.tokenizer.encode(env.tokenizer.decode([code]) + ".")
        assert page.text.endswith("\nThe code is") and "The code is" in page.text.removesuffix("\nThe code is")
        drawn.add(code)
        again = env.drill_document(np.random.default_rng(tokens), tokens)
        assert [s.token_ids.tolist() for s in again.segments] == [s.token_ids.tolist() for s in document.segments]
    assert PageRecallEnv.has_drill()


def test_the_pages_are_the_same_draws_as_before_the_drill_shared_their_maker() -> None:
    """``_page`` serves both the task and the drill: the task's pages must stay the draws they were (every seed's
    episode, and the stores and figures made from them). Page 1 of seed 0 at 2 pages of 40 tokens, as written
    before."""
    env = PageRecallEnv(pages=2, page_tokens=40, codes=8)
    env.reset(seed=0)
    rng = np.random.default_rng(0)  # the draws in make_task's order: the code, then each page's lines and place
    pools, words = word_pools(env.tokenizer), env.code_words()
    code = words[int(rng.integers(8))]
    lines = rng.integers(len(pools.filler), size=(40 // 9, 8))
    first = ["".join(pools.filler[i] for i in row) + "." for row in lines]
    first.insert(int(rng.integers(40 // 9 + 1)), f"The code is{code}.")
    assert env.task.pages[0] == "\n".join(["Page 1 of 2.", *first]) and env.task.code == code


def test_a_scripted_summariser_that_reads_the_code_right_only_sometimes() -> None:
    """``scripted_keeps``: a scripted episode either carries page 1's code through every summary and answers it, or
    its first summary states a code drawn at random, which every later summary and the answer carry. The pages are
    the default's for the same seed (the choice is drawn after them), and the share follows the setting."""
    read_right = 0
    for seed in range(12):
        default = PageRecallEnv(context=SUMMARY_4K, pages=3, codes=8)
        env = PageRecallEnv(context=SUMMARY_4K, pages=3, codes=8, scripted_keeps=0.5)
        default.reset(seed=seed)
        trajectory = run_episode(env, ScriptedPolicy(env), seed=seed)
        assert env.task.pages == default.task.pages and env.task.code == default.task.code
        segments = trajectory.segments
        replies = [after for before, after in zip(segments, segments[1:], strict=False) if before.role == "user"]
        summaries = [s.text for s in replies if s.role == "assistant" and not s.text.startswith("<tool_call>")]
        carried = env.task.code if env.task.scripted_guess is None else env.task.scripted_guess
        read_right += env.task.scripted_guess is None
        assert carried in env.code_words()[:8] and len(summaries) == env.config.pages
        assert all(s.startswith(f"The code is{carried}.") for s in summaries)
        assert trajectory.segments[-1].text.startswith(f"<answer>{carried}</answer>")
        assert trajectory.reward == float(carried == env.task.code)
    assert 3 <= read_right <= 9
    # at the default no guess is drawn: the tasks are the ones drawn before the setting existed
    env = PageRecallEnv(pages=2, page_tokens=100)
    env.reset(seed=0)
    assert env.task.scripted_guess is None
    with pytest.raises(ValueError, match="scripted_keeps"):
        PageRecallConfig(scripted_keeps=1.5)
