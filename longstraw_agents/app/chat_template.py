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

``JINJA_CHAT_TEMPLATE`` is the same format as a transformers chat template, which ``longstraw export`` saves with
the tokenizer: ``tokenizer.apply_chat_template(messages, tools=schemas)`` gives the very ids ``ChatFormatter``
renders for that conversation (the environments' prompts, turns, tool calls and results), ids an episode produced
included. Its fixed text (the tool list's frame, the call and answer format) is taken from the functions the
environments call, so the two cannot drift apart.

The serving layer may not import the agent side (environments, tools); this app-layer class joins them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from longstraw_agents.chat import SEPARATOR, TOOL_RESPONSE_END, TOOL_RESPONSE_START, ChatFormatter
from longstraw_agents.envs import schema_instructions, system_prompt_with_tools
from longstraw_agents.serving import ChatMessage, FunctionCall, Reply
from longstraw_agents.tokenizer import IM_END, IM_START, Tokenizer
from longstraw_agents.tools import ToolCall, format_tool_call, parse_tool_calls
from longstraw_agents.tools.parsing import CLOSE_TAG, OPEN_TAG


class QwenChatTemplate:
    """ChatML with Qwen-style tools, rendered by ``ChatFormatter`` for ``tokenizer`` (which must have the ChatML
    special tokens)."""

    def __init__(self, tokenizer: Tokenizer):
        self.formatter = ChatFormatter(tokenizer)

    def render(self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]]) -> list[int]:
        """The conversation's ids, ending with the generation prompt of the assistant turn to write."""
        if messages and messages[-1].role == "assistant":
            raise ValueError("the last message is the assistant's; end with a user, system or tool message")
        return self.formatter.render_messages(formatter_messages(messages, tools)).token_ids().tolist()

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


def formatter_messages(messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The conversation as ``ChatFormatter`` takes it: the tools in the system message (one made for them when there
    is none), each assistant message's tool calls in its text."""
    plain = [{"role": m.role, "content": _message_text(m)} for m in messages]
    if tools:
        if plain and plain[0]["role"] == "system":
            plain[0] = {"role": "system", "content": system_prompt_with_tools(plain[0]["content"], tools)}
        else:
            plain.insert(0, {"role": "system", "content": schema_instructions(tools)})
    return plain


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


# --------------------------------------------------------------------------------------------------------------------
# The same format as a transformers chat template
# --------------------------------------------------------------------------------------------------------------------

# The body of the template: ChatMessage's rules above, on OpenAI-style messages (``content`` a string or absent,
# ``tool_calls`` as ``{"function": {"name", "arguments"}}`` or ``{"name", "arguments"}``). Every character it writes
# comes from an expression, so that transformers' whitespace options cannot add any.
_TEMPLATE_BODY = r"""
{%- if tools %}
    {%- set tool_text = tools_open + (tools | map("tojson") | join("\n")) + tools_close %}
    {%- if messages and messages[0].role == "system" %}
        {%- set instructions = messages[0].content if messages[0].content is string else "" %}
        {%- set system = {"role": "system", "content": instructions + instructions_end + tool_text} %}
        {%- set messages = [system] + messages[1:] %}
    {%- else %}
        {%- set messages = [{"role": "system", "content": tool_text}] + messages %}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(answered=false, parts=[]) %}
{%- for message in messages %}
    {%- set role = message.role %}
    {%- if message.content is defined and message.content is not none and message.content is not string %}
        {{- raise_exception("message " ~ loop.index0 ~ ": content must be a string") }}
    {%- endif %}
    {%- set content = message.content if message.content is string else "" %}
    {%- if role not in ["system", "user", "assistant", "tool"] %}
        {{- raise_exception(
            "message " ~ loop.index0 ~ ": unknown role " ~ role ~ "; expected system, user, assistant or tool"
        ) }}
    {%- endif %}
    {%- if loop.first and role not in ["system", "user"] %}
        {{- raise_exception("a conversation starts with a system or user message") }}
    {%- endif %}
    {%- if role == "assistant" %}
        {%- if loop.previtem.role == "assistant" %}
            {{- raise_exception(
                "message " ~ loop.index0 ~ ": two assistant messages in a row need a message between them"
            ) }}
        {%- endif %}
        {%- set ns.parts = [content] if content else [] %}
        {%- for call in (message.tool_calls if message.tool_calls is defined and message.tool_calls else []) %}
            {%- set function = call.function if call.function is defined else call %}
            {%- if function.arguments is string %}
                {%- set payload = '{"name": ' ~ (function.name | tojson) ~ ', "arguments": '
                    ~ function.arguments ~ "}" %}
            {%- else %}
                {%- set given = function.arguments is defined and function.arguments is not none %}
                {%- set arguments = function.arguments if given else {} %}
                {%- set payload = {"name": function.name, "arguments": arguments} | tojson %}
            {%- endif %}
            {%- set ns.parts = ns.parts + [tool_call_open + "\n" + payload + "\n" + tool_call_close] %}
        {%- endfor %}
        {%- set text = ns.parts | join("\n") %}
        {{- text }}
        {%- if not text.endswith(im_end) %}
            {{- im_end }}
        {%- endif %}
        {%- set ns.answered = true %}
    {%- else %}
        {%- if role == "tool" and not ns.answered %}
            {{- raise_exception("message " ~ loop.index0 ~ ": a tool message must follow an assistant turn") }}
        {%- endif %}
        {%- set response = tool_response_open + "\n" + content + "\n" + tool_response_close %}
        {%- if role == "tool" and loop.previtem.role == "tool" %}
            {{- separator + response }}
        {%- else %}
            {{- (separator if not loop.first else "") + im_start + role + "\n" }}
            {{- response if role == "tool" else content }}
        {%- endif %}
        {%- if not (role == "tool" and not loop.last and loop.nextitem.role == "tool") %}
            {{- im_end }}
        {%- endif %}
        {%- if (not loop.last and loop.nextitem.role == "assistant") or (loop.last and add_generation_prompt) %}
            {{- separator + im_start + "assistant\n" }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
"""


def _tool_prompt_frame() -> dict[str, str]:
    """The fixed text of a system prompt with tools, as the environments write it: what precedes the schemas (one
    JSON line each) and what follows them (``schema_instructions``), and what joins it to the instructions
    (``system_prompt_with_tools``)."""
    schemas = [{"name": "first"}, {"name": "second"}]
    lines = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    tools_open, tools_close = schema_instructions(schemas).split(lines)
    instructions_end = system_prompt_with_tools("", schemas).removesuffix(schema_instructions(schemas))
    return {"tools_open": tools_open, "tools_close": tools_close, "instructions_end": instructions_end}


def jinja_chat_template() -> str:
    """``QwenChatTemplate``'s format as a Jinja chat template for transformers (``tokenizer.chat_template``)."""
    names = {
        "im_start": IM_START,
        "im_end": IM_END,
        "separator": SEPARATOR,
        "tool_call_open": OPEN_TAG,
        "tool_call_close": CLOSE_TAG,
        "tool_response_open": TOOL_RESPONSE_START,
        "tool_response_close": TOOL_RESPONSE_END,
        **_tool_prompt_frame(),
    }
    # JSON string literals are Jinja string literals (Jinja reads their escapes as Python does)
    preamble = "".join(f"{{%- set {name} = {json.dumps(text)} %}}\n" for name, text in names.items())
    return preamble + _TEMPLATE_BODY.strip()


JINJA_CHAT_TEMPLATE = jinja_chat_template()
