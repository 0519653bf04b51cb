"""ChatML rendered straight to token ids, one ``Segment`` per message, never by re-tokenising a transcript.

Conventions (other modules code against them):

- A message is ``<|im_start|>{role}\\n{content}<|im_end|>``; messages are separated by ``\\n``. The separator leads
  every context message except the first, so a segment can always be appended to what came before.
- The generation prompt is ``\\n<|im_start|>assistant\\n``. It ends the last context segment before the model's
  turn, so what the model writes next is the assistant's content.
- An assistant action is ``content<|im_end|>``: the model stops at ``<|im_end|>`` (``tokenizer.eos_token_id``). It
  is a ``Segment(role="assistant")`` whose tokens all carry loss.
- An observation after an assistant turn is ``\\n<|im_start|>{role}\\n{content}<|im_end|>`` followed by the
  generation prompt (unless it ends the episode): role ``tool`` for tool results, ``user`` for user messages.
- Tool results are wrapped as ``<tool_response>\\n{result}\\n</tool_response>`` (Qwen's convention); several results
  of one turn go into one tool message, separated by ``\\n``.

Trust: message content from users, documents and tools is encoded as plain text (``tokenizer.encode(text)``), so a
control-token string inside it (``<|im_end|>``) stays text; only the assistant's own text (what a policy would emit)
and the template's control tokens become control ids. Tags (``<tool_call>``, ``<answer>``...) are words of the
vocabulary, their ids in any text: the system prompt that describes them as in the turns that use them. Between
two control tokens, each text run is encoded in one piece, exactly as tiktoken and HF tokenizers split text on
added tokens, so a rendered conversation re-encodes to the same ids (transformers' ``apply_chat_template`` with the
template ``longstraw export`` writes) unless its content holds control-token strings (``longstraw_agents.drift``
finds those cases).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from longstraw_agents.tokenizer import ENDOFTEXT, IM_END, IM_START, Tokenizer
from longstraw_agents.trajectory import Role, Segment, Trajectory

TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
SEPARATOR = "\n"

Message = Mapping[str, Any]

_PROMPT_ROLES = ("system", "user")
_OBSERVATION_ROLES = ("system", "user", "tool")


@dataclass(frozen=True)
class Control:
    """A control token of the template: emitted by its id, or as text when the tokenizer does not have it."""

    token: str


Part = str | Control


@dataclass(frozen=True)
class _Block:
    """One segment-to-be: template parts of a context message, or the raw text of an assistant turn."""

    role: Role
    turn: int
    parts: tuple[Part, ...] = ()
    assistant_text: str | None = None


class ChatFormatter:
    """Renders ChatML messages to token ids and ``Segment``s for one tokenizer.

    The tokenizer must have ``<|im_start|>`` and ``<|im_end|>`` as special tokens; the tool-response tags are used
    as control tokens when it has them and written as text otherwise.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._special_tokens = tokenizer.special_tokens
        for token in (IM_START, IM_END):
            tokenizer.special_token_id(token)  # raises a KeyError that names the known specials
        if tokenizer.eos_token_id != tokenizer.special_token_id(IM_END):
            raise ValueError(f"{tokenizer.name}: eos_token_id must be {IM_END!r} for ChatML")

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end an assistant turn: ``<|im_end|>`` first, then ``<|endoftext|>`` when the tokenizer has it."""
        eos = self._tokenizer.eos_token_id
        endoftext = self._special_tokens.get(ENDOFTEXT)
        return (eos,) if endoftext is None or endoftext == eos else (eos, endoftext)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tokenizer.decode(ids)

    def ends_turn(self, ids: Sequence[int] | np.ndarray) -> bool:
        """Whether an assistant action ends with a stop token (one the sampler cut at its length limit does not)."""
        return len(ids) > 0 and int(ids[-1]) in self.stop_token_ids

    def closing(self, segment: Segment) -> Segment:
        """``segment`` as the message after an action that did not end its turn: ``<|im_end|>`` first closes it, so
        the context stays well-formed ChatML."""
        ids = np.concatenate([np.array([self._tokenizer.eos_token_id], dtype=np.int32), segment.token_ids])
        return Segment(
            role=segment.role, token_ids=ids, turn=segment.turn, text=self.decode(ids), tool_calls=segment.tool_calls
        )

    # ----------------------------------------------------------------------------------------------------------------
    # Segments of an episode, in the order an environment produces them
    # ----------------------------------------------------------------------------------------------------------------

    def prompt(
        self, messages: Sequence[Message], turn: int = 0, *, add_generation_prompt: bool = True
    ) -> list[Segment]:
        """The opening context: one segment per system/user message, the last ending with the generation prompt."""
        if not messages:
            raise ValueError("a prompt needs at least one system or user message")
        run = [_checked_message(m, i) for i, m in enumerate(messages)]
        for i, (role, _) in enumerate(run):
            if role not in _PROMPT_ROLES:
                raise ValueError(f"message {i}: a prompt holds {' and '.join(_PROMPT_ROLES)} messages, not {role!r}")
        blocks = self._context_blocks(run, turn, first=True, generation_prompt=add_generation_prompt)
        return [self._segment(block) for block in blocks]

    def assistant(
        self,
        ids_or_text: str | Sequence[int] | np.ndarray,
        turn: int,
        logprobs: Sequence[float] | np.ndarray | None = None,
        *,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> Segment:
        """One assistant action. Ids (what the policy sampled) are taken as they are, with or without the final
        ``<|im_end|>``; text is encoded as a policy would emit it (special tokens allowed) and gets ``<|im_end|>``
        appended unless it already ends with it."""
        ids: Sequence[int] | np.ndarray
        if isinstance(ids_or_text, str):
            ids = self._tokenizer.encode(_assistant_text(ids_or_text), allow_special=True)
        else:
            ids = ids_or_text
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(ids)} assistant tokens")
        segment = Segment(
            role="assistant", token_ids=np.asarray(ids), logprobs=logprobs, turn=turn, tool_calls=tool_calls
        )
        return dataclasses.replace(segment, text=self.decode(segment.token_ids))  # decode the validated ids

    def observation(
        self,
        role: Role,
        content: str,
        turn: int,
        add_generation_prompt: bool = True,
        *,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> Segment:
        """What the environment appends after an assistant turn. For role ``tool``, ``content`` is one tool result
        and is wrapped in ``<tool_response>`` tags; use ``tool_observation`` for several."""
        if role not in _OBSERVATION_ROLES:
            raise ValueError(f"an observation has role {', '.join(_OBSERVATION_ROLES)}; got {role!r}")
        _check_content(content, what=f"{role} observation")
        body = self._tool_response_parts([content]) if role == "tool" else (content,)
        parts = self._context_parts(role, body, separator=True, generation_prompt=add_generation_prompt)
        return self._segment(_Block(role, turn, parts), tool_calls=tool_calls)

    def tool_observation(
        self,
        results: Sequence[str],
        turn: int,
        add_generation_prompt: bool = True,
        *,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> Segment:
        """The results of one turn's tool calls, in call order, as one tool message."""
        if isinstance(results, str) or not results:
            raise ValueError("tool_observation takes a non-empty list of result strings")
        for i, result in enumerate(results):
            _check_content(result, what=f"tool result {i}")
        body = self._tool_response_parts(results)
        parts = self._context_parts("tool", body, separator=True, generation_prompt=add_generation_prompt)
        return self._segment(_Block("tool", turn, parts), tool_calls=tool_calls)

    # ----------------------------------------------------------------------------------------------------------------
    # Whole conversations
    # ----------------------------------------------------------------------------------------------------------------

    def render_messages(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> Trajectory:
        """A whole conversation as segments: the prompt, then per turn the assistant action and the observation
        that answers it (consecutive tool messages form one observation). A conversation that ends with a context
        message ends with the generation prompt unless ``add_generation_prompt`` is False."""
        blocks = self._conversation_blocks(messages, add_generation_prompt)
        return Trajectory(segments=[self._segment(block) for block in blocks])

    def render_text(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> str:
        """The same conversation as one string: what a text-level chat template would produce."""
        blocks = self._conversation_blocks(messages, add_generation_prompt)
        return "".join(self._block_text(block) for block in blocks)

    # ----------------------------------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------------------------------

    def _conversation_blocks(self, messages: Sequence[Message], add_generation_prompt: bool) -> list[_Block]:
        checked = [_checked_message(m, i) for i, m in enumerate(messages)]
        if not checked or checked[0][0] not in _PROMPT_ROLES:
            raise ValueError("a conversation starts with a system or user message")
        blocks: list[_Block] = []
        run: list[tuple[Role, str]] = []
        turn = 0
        for index, (role, content) in enumerate(checked):
            if role != "assistant":
                if not blocks and role == "tool":
                    raise ValueError(f"message {index}: a tool message must follow an assistant turn")
                run.append((role, content))
                continue
            if run:
                blocks += self._context_blocks(run, max(turn - 1, 0), first=not blocks, generation_prompt=True)
                run = []
            elif blocks and blocks[-1].assistant_text is not None:
                raise ValueError(f"message {index}: two assistant messages in a row need a message between them")
            blocks.append(_Block("assistant", turn, assistant_text=content))
            turn += 1
        if run:
            blocks += self._context_blocks(
                run, max(turn - 1, 0), first=not blocks, generation_prompt=add_generation_prompt
            )
        return blocks

    def _context_blocks(
        self, run: Sequence[tuple[Role, str]], turn: int, *, first: bool, generation_prompt: bool
    ) -> list[_Block]:
        """One block per message of a run of context messages; consecutive tool results share one block."""
        grouped: list[tuple[Role, list[str]]] = []
        for role, content in run:
            if role == "tool" and grouped and grouped[-1][0] == "tool":
                grouped[-1][1].append(content)
            else:
                grouped.append((role, [content]))
        blocks = []
        for i, (role, contents) in enumerate(grouped):
            body = self._tool_response_parts(contents) if role == "tool" else (contents[0],)
            is_last = i == len(grouped) - 1
            parts = self._context_parts(
                role, body, separator=not (first and i == 0), generation_prompt=generation_prompt and is_last
            )
            blocks.append(_Block(role, turn, parts))
        return blocks

    @staticmethod
    def _context_parts(
        role: str, body: Sequence[Part], *, separator: bool, generation_prompt: bool
    ) -> tuple[Part, ...]:
        parts: list[Part] = [SEPARATOR] if separator else []
        parts += [Control(IM_START), f"{role}\n", *body, Control(IM_END)]
        if generation_prompt:
            parts += [SEPARATOR, Control(IM_START), "assistant\n"]
        return tuple(parts)

    @staticmethod
    def _tool_response_parts(results: Sequence[str]) -> tuple[Part, ...]:
        parts: list[Part] = []
        for i, result in enumerate(results):
            if i:
                parts.append(SEPARATOR)
            parts += [Control(TOOL_RESPONSE_START), f"\n{result}\n", Control(TOOL_RESPONSE_END)]
        return tuple(parts)

    def _block_text(self, block: _Block) -> str:
        if block.assistant_text is not None:
            return _assistant_text(block.assistant_text)
        return "".join(part.token if isinstance(part, Control) else part for part in block.parts)

    def _encode_parts(self, parts: Sequence[Part]) -> list[int]:
        """Control tokens by id; the text between two of them is encoded as plain text, in one piece."""
        ids: list[int] = []
        text: list[str] = []
        for part in parts:
            if isinstance(part, Control) and part.token in self._special_tokens:
                ids += self._encode_plain("".join(text))
                text = []
                ids.append(self._special_tokens[part.token])
            else:
                text.append(part.token if isinstance(part, Control) else part)
        return ids + self._encode_plain("".join(text))

    def _encode_plain(self, text: str) -> list[int]:
        return self._tokenizer.encode(text) if text else []

    def _segment(self, block: _Block, *, tool_calls: list[dict[str, Any]] | None = None) -> Segment:
        if block.assistant_text is not None:
            return self.assistant(block.assistant_text, block.turn, tool_calls=tool_calls)
        ids = np.asarray(self._encode_parts(block.parts), dtype=np.int32)
        return Segment(role=block.role, token_ids=ids, turn=block.turn, text=self.decode(ids), tool_calls=tool_calls)


def _assistant_text(content: str) -> str:
    return content if content.endswith(IM_END) else content + IM_END


def _check_content(content: object, *, what: str) -> None:
    if not isinstance(content, str):
        raise TypeError(f"{what}: content must be a string, got {type(content).__name__}")


def _checked_message(message: Message, index: int) -> tuple[Role, str]:
    if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
        raise ValueError(f"message {index}: expected a mapping with 'role' and 'content', got {message!r:.120}")
    role, content = message["role"], message["content"]
    if role not in ("system", "user", "assistant", "tool"):
        raise ValueError(f"message {index}: unknown role {role!r}; expected system, user, assistant or tool")
    _check_content(content, what=f"message {index} ({role})")
    return role, content
