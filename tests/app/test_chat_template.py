"""app/chat_template.py: chat requests render to the very ids an environment gives its policy (prompt, tool turn,
tool results), and generated text reads back as content and tool calls, streamed content being a prefix of it."""

from __future__ import annotations

import gymnasium
import pytest

from longstraw_agents.app.chat_template import QwenChatTemplate
from longstraw_agents.envs import EASY_CALCULATOR_KWARGS, ScriptedPolicy, unwrap_tool_env
from longstraw_agents.serving import ChatMessage, FunctionCall, Reply
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.tools import format_tool_call

TOKENIZER = load_tokenizer()
TEMPLATE = QwenChatTemplate(TOKENIZER)


@pytest.fixture
def calculator():
    env = gymnasium.make("LongStraw/Calculator-v0", **EASY_CALCULATOR_KWARGS)
    yield env
    env.close()


def opening(env: gymnasium.Env) -> list[ChatMessage]:
    """The system and user messages of the env's current episode, as a chat client would send them."""
    tool_env = unwrap_tool_env(env)
    return [
        ChatMessage("system", tool_env.instructions),
        ChatMessage("user", tool_env.user_prompt(tool_env.task)),
    ]


def test_a_request_with_the_envs_tools_renders_the_envs_prompt(calculator) -> None:
    prompt, _ = calculator.reset(seed=3)
    schemas = unwrap_tool_env(calculator).registry.schemas()
    assert TEMPLATE.render(opening(calculator), schemas) == prompt.tolist()


def test_a_tool_turn_and_its_result_render_as_the_episode_went_on(calculator) -> None:
    calculator.reset(seed=3)
    messages = opening(calculator)
    _, _, _, _, info = calculator.step(ScriptedPolicy(calculator)())
    [call] = info["tool_calls"]
    [result] = info["tool_results"]
    messages += [
        ChatMessage("assistant", "", (FunctionCall(call["name"], call["arguments"]),)),
        ChatMessage("tool", result["content"]),
    ]
    schemas = unwrap_tool_env(calculator).registry.schemas()
    rendered = TEMPLATE.render(messages, schemas)
    assert rendered == unwrap_tool_env(calculator).trajectory.token_ids().tolist()


def test_tools_without_a_system_message_make_one_and_no_tools_leave_it_alone() -> None:
    schemas = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    user = [ChatMessage("user", "What time is it?")]
    text = TOKENIZER.decode(TEMPLATE.render(user, schemas))
    assert text.startswith("<|im_start|>system\nTools:\n<tools>\n") and '"name": "now"' in text
    plain = TOKENIZER.decode(TEMPLATE.render([ChatMessage("system", "Be brief."), *user], []))
    assert plain == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat time is it?<|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )


def test_an_assistant_message_writes_its_content_then_its_calls_one_a_line() -> None:
    call = FunctionCall("calculator", {"expression": "2+3"})
    messages = [ChatMessage("user", "2+3?"), ChatMessage("assistant", "Computing.", (call,)), ChatMessage("tool", "5")]
    text = TOKENIZER.decode(TEMPLATE.render(messages, []))
    assert (
        f"<|im_start|>assistant\nComputing.\n{format_tool_call('calculator', {'expression': '2+3'})}<|im_end|>" in text
    )


def test_a_conversation_must_end_before_the_assistant_turn_it_asks_for() -> None:
    with pytest.raises(ValueError, match="last message is the assistant's"):
        TEMPLATE.render([ChatMessage("user", "hi"), ChatMessage("assistant", "hello")], [])
    with pytest.raises(ValueError, match="tool message must follow an assistant turn"):
        TEMPLATE.render([ChatMessage("system", "s"), ChatMessage("tool", "5")], [])


CALLS_TEXT = (
    "Let me compute both.\n"
    + format_tool_call("calculator", {"expression": "2+3"})
    + "\nand\n"
    + format_tool_call("calculator", {"expression": "4*5"})
    + "\n"
)


def test_well_formed_calls_are_read_and_the_text_around_them_is_the_content() -> None:
    reply = TEMPLATE.reply(CALLS_TEXT)
    assert reply == Reply(
        "Let me compute both.\n\nand",
        (FunctionCall("calculator", {"expression": "2+3"}), FunctionCall("calculator", {"expression": "4*5"})),
    )
    assert TEMPLATE.reply("  The answer is 5. ") == Reply("The answer is 5.")


def test_a_malformed_call_stays_in_the_content() -> None:
    text = "Trying <tool_call>{not json}</tool_call>"
    assert TEMPLATE.reply(text) == Reply(text)


@pytest.mark.parametrize("text", [CALLS_TEXT, "Answer: <tool_call>{broken</tool_call> done", "  <tool_c", "a < b"])
def test_streamed_content_is_always_a_prefix_of_the_final_content(text: str) -> None:
    final = TEMPLATE.reply(text).content
    for end in range(len(text) + 1):
        assert final.startswith(TEMPLATE.streamable(text[:end])), text[:end]
    assert TEMPLATE.streamable("Let me compute <tool_") == "Let me compute"
