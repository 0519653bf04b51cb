"""The chat format the environments train with, behind ``serving.ChatTemplate``: what ``/v1/chat/completions``
renders and reads, so that a served policy sees exactly the prompts of its training.

- Messages are rendered to ids by the project's ``ChatFormatter`` (ChatML, Qwen's convention): never a text template
  re-tokenised, so a conversation an environment produced renders to the ids the policy was trained on.
- A request's ``tools`` (OpenAI function schemas) go into the system message as every ``ToolEnv`` writes them
  (``envs.system_prompt_with_tools``: the schemas as JSON lines in ``<tools>``, then the call and answer format);
  without a system message they make one.
- An assistant message's ``tool_calls`` are written as the policy writes them (``tools.format_tool_call``, one
  ``<tool_call>`` block a line after the content); tool messages become ``<tool_response>`` blocks, consecutive ones
  in one tool turn.
- A reply's well-formed ``<tool_call>`` blocks (``tools.parse_tool_calls``) are its tool calls; the text around them,
  stripped, is its content. A malformed block stays in the content, as the environment would answer it with an error.

The serving layer may not import the agent side (environments, tools); this app-layer class joins them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from longstraw_agents.chat import ChatFormatter
from longstraw_agents.envs import schema_instructions, system_prompt_with_tools
from longstraw_agents.serving import ChatMessage, FunctionCall, Reply
from longstraw_agents.tokenizer import Tokenizer
from longstraw_agents.tools import ToolCall, format_tool_call, parse_tool_calls
from longstraw_agents.tools.parsing import OPEN_TAG


class QwenChatTemplate:
    """ChatML with Qwen-style tools, rendered by ``ChatFormatter`` for ``tokenizer`` (which must have the ChatML
    special tokens)."""

    def __init__(self, tokenizer: Tokenizer):
        self.formatter = ChatFormatter(tokenizer)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        """The conversation's ids, ending with the generation prompt of the assistant turn to write."""
        if messages and messages[-1].role == "assistant":
            raise ValueError("the last message is the assistant's; end with a user, system or tool message")
        plain = [{"role": m.role, "content": _message_text(m)} for m in messages]
        if tools:
            if plain and plain[0]["role"] == "system":
                plain[0] = {"role": "system", "content": system_prompt_with_tools(plain[0]["content"], tools)}
            else:
                plain.insert(0, {"role": "system", "content": schema_instructions(tools)})
        return self.formatter.render_messages(plain).token_ids().tolist()

    def reply(self, text: str) -> Reply:
        """The well-formed ``<tool_call>`` blocks of ``text`` as calls; the rest, stripped, as content."""
        calls = [call for call in parse_tool_calls(text) if isinstance(call, ToolCall)]
        pieces, end = [], 0
        for call in calls:
            assert call.span is not None  # parse_tool_calls gives every call its span
            pieces.append(text[end : call.span[0]])
            end = call.span[1]
        pieces.append(text[end:])
        return Reply("".join(pieces).strip(), tuple(FunctionCall(c.name, dict(c.arguments)) for c in calls))

    def streamable(self, text: str) -> str:
        """The content known before the text ends: what precedes its first ``<tool_call>`` (or a trailing piece of
        one), stripped."""
        cut = text.find(OPEN_TAG)
        if cut == -1:
            cut = len(text) - _partial_tag_length(text)
        return text[:cut].strip()


def _message_text(message: ChatMessage) -> str:
    """The content of a message; an assistant's tool calls follow it, one a line, as the policy writes them."""
    calls = [format_tool_call(call.name, call.arguments) for call in message.tool_calls]
    return "\n".join([message.content, *calls] if message.content else calls)


def _partial_tag_length(text: str) -> int:
    """The length of the longest end of ``text`` that begins ``<tool_call>`` (a tag split across tokens)."""
    for length in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if text.endswith(OPEN_TAG[:length]):
            return length
    return 0
