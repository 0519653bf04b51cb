"""`ToolEnv`: the token-in / token-out Gymnasium environment that every LongStraw task subclasses.

An episode, in token ids (ChatML, rendered by `ChatFormatter`; see ``longstraw_agents/chat.py``)::

    reset()      → the prompt: system message, user message, generation prompt ("\\n<|im_start|>assistant\\n")
    step(action) ← one assistant turn: the ids the policy sampled, normally ending with <|im_end|>
                 → the ids to append: the tool results (or a correction) as the next message + generation prompt

Nothing is ever re-tokenized. The prompt, every action and every observation become `Segment`\\ s of
``env.unwrapped.trajectory`` exactly as they were exchanged, so ``trajectory.token_ids()`` is the concatenation of
everything ``reset`` and ``step`` returned and received (without a context policy: see below). Each turn is read as
follows:

1. A turn that alone takes the episode past ``max_tokens`` ends it: ``truncated``, finish reason
   ``"max_tokens"``, reward 0, even if it holds an answer (the budget binds what gets scored).
2. An ``<answer>…</answer>`` block ends the episode: ``terminated``, reward ``score(task, answer)``. Tool calls
   in the same turn are not run.
3. Otherwise, the turn that spends the turn budget ends the episode: ``truncated``, finish reason
   ``"max_turns"``, reward 0; its tool calls are not run (nobody would read their results).
4. Otherwise the turn's ``<tool_call>`` blocks are run in order (several per turn are fine) and their results,
   failures included, are the next observation (role ``tool``). A turn with neither a call nor an answer — random
   tokens, say — gets a user message saying how to call a tool or answer. Nothing the policy writes raises.
5. An observation that would take the episode past ``max_tokens`` is not appended: ``truncated``, finish reason
   ``"max_tokens"``, reward 0.

With a context policy (``env.context_policy``: built from ``ToolEnvConfig.context``, or any ``ContextPolicy`` given
as ``context_policy``; see ``envs.context``) the context may also be edited: at each tool turn the policy plans what
follows the observation (evicting old tool outputs, asking for a summary turn...), and a turn that replies to its
request goes to the policy instead of the tools (a summary then replaces the turns so far). The step that edits
returns the whole new context instead of the ids to append, and its ``info["context_edit"]`` says how many leading
tokens were kept; a plan that cannot keep the context under its budget ends the episode (``"context_limit"``,
reward 0), and what a plan logs counts in ``max_tokens``. The trajectory logs every segment and the edits, and its
physical sequences are the contexts the policy conditioned on.

The observation that ends an episode is empty: nothing follows the final action. A turn that does not end with a
stop token (the sampler hit its length limit) is closed by the environment: the next observation starts with
``<|im_end|>``, so the context stays well-formed ChatML. Behaviour logprobs of an action can be given with
``record_logprobs`` before ``step`` or in a dict action ``{"token_ids": ids, "logprobs": lps}``; the dict may also
say which ``policy_version`` sampled the action (recorded on its segment: asynchronous GRPO's episodes hold turns of
several versions).

A task is a subclass that fills in a few hooks: ``make_task(rng)`` (deterministic given the generator),
``user_prompt(task)``, ``score(task, answer)`` and usually ``tools(task)``; ``system_prompt(task)`` and
``scripted_turns(task)`` (the oracle used by `ScriptedPolicy`) are optional.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.error import ResetNeeded
from pydantic import BaseModel, ConfigDict, Field

from longstraw_agents.chat import ChatFormatter
from longstraw_agents.tokenizer import Tokenizer, load_tokenizer
from longstraw_agents.tools import Tool, ToolCall, ToolCallError, ToolRegistry, ToolResult, parse_tool_calls
from longstraw_agents.trajectory import EditKind, FinishReason, Segment, Trajectory

from .answers import ANSWER_CLOSE, ANSWER_OPEN, find_answer
from .context import ContextChange, ContextConfig, ContextPlan, ContextPolicy, ContextView, Unbounded, kept_tokens

TaskT = TypeVar("TaskT")

Action = Sequence[int] | np.ndarray | Mapping[str, Any]
"""Token ids of one assistant turn, or ``{"token_ids": ids, "logprobs": behaviour_logprobs, "policy_version": v}``
(both optional)."""

ToolExecutor = Callable[[ToolCall | ToolCallError], ToolResult]
"""What answers a parsed tool call (or a malformed one) with a result: the episode's registry by default."""

DEFAULT_TOKENIZER = "longstraw-bpe"
SEED_BOUND = 2**31
"""Episode seeds drawn by ``reset()`` without a seed lie in ``[0, SEED_BOUND)``."""
RESET_OPTIONS = ("group_id", "policy_version")


class ToolEnvConfig(BaseModel):
    """Budgets shared by every `ToolEnv`; subclasses extend it with their task's settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(
        default=8, ge=1, description="Assistant turns per episode; the last one truncates the episode."
    )
    max_tokens: int = Field(
        default=16_384,
        ge=1,
        description="Token budget of the whole episode: prompt, actions and observations (every segment logged, "
        "evicted ones included).",
    )
    context: ContextConfig | None = Field(
        default=None,
        description="Keep the context under a budget by evicting tool outputs or by summary turns (envs.context); "
        "None: the context is the whole episode (unless the env is given a context_policy object).",
    )


@dataclass(frozen=True)
class Score:
    """What ``score`` may return instead of a plain float: the reward plus details kept in the trajectory's info."""

    reward: float
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass
class _Episode(Generic[TaskT]):
    """The running episode: the log, the current context, the budgets spent. A context plan applies to it
    (``envs.context.ContextLog``)."""

    task: TaskT
    registry: ToolRegistry
    trajectory: Trajectory
    seed: int
    turn: int = 0
    num_tokens: int = 0
    done: bool = False
    pending_logprobs: np.ndarray | None = None
    context: list[int] = field(default_factory=list)  # log indices of the current context
    awaiting_reply: bool = False  # the next action replies to the context policy's request
    replies: int = 0  # turns that replied to the context policy

    def append(self, segment: Segment) -> None:
        self.context.append(len(self.trajectory.segments))
        self.trajectory.append(segment)
        self.num_tokens += len(segment)

    def replace(self, removed: Sequence[int], replacement: Segment | int | None, kind: EditKind) -> None:
        self.context = self.trajectory.edit(removed, replacement, kind).applied_to(self.context)
        if isinstance(replacement, Segment):  # a new segment is logged (one reused was counted when it was)
            self.num_tokens += len(replacement)

    @property
    def context_tokens(self) -> int:
        return self.trajectory.num_tokens_of(self.context)

    def context_ids(self) -> np.ndarray:
        return np.concatenate([self.trajectory.segments[k].token_ids for k in self.context]).astype(np.int64)

    def draft(self) -> _Episode[TaskT]:
        """A copy to try a turn on: what is logged and edited in it leaves this episode as it is."""
        log = Trajectory(segments=list(self.trajectory.segments), edits=list(self.trajectory.edits))
        return dataclasses.replace(self, trajectory=log, context=list(self.context))

    def log_turn(self, action_segment: Segment, observations: list[Segment], plan: ContextPlan) -> _Episode[TaskT]:
        """Log a turn: the action, what answers it, then the context plan's steps; returns this episode."""
        self.append(action_segment)
        for segment in observations:
            self.append(segment)
        plan.apply(self)
        return self

    def view(self, formatter: ChatFormatter) -> ContextView:
        """The episode as its context policy reads it."""
        return ContextView(self.trajectory, tuple(self.context), self.turn, self.seed, formatter)


class ToolEnv(gymnasium.Env[np.ndarray, Action], Generic[TaskT]):
    """A multi-turn tool-using task with token-id actions and observations (see the module docstring).

    Args:
        config: Budgets (and, in subclasses, task settings); keyword ``overrides`` replace its fields, so
            ``gymnasium.make(env_id, max_turns=4)`` works. Invalid values raise pydantic's ``ValidationError``.
        tokenizer: A `Tokenizer` or a spec for ``load_tokenizer`` (the shipped BPE by default).
        render_mode: None or ``"ansi"`` (``render()`` returns the episode's text).
        context_policy: A `ContextPolicy` object instead of ``config.context`` (a policy of one's own; one of the
            two at most). Neither: the context is the whole episode.
    """

    # render_fps only matters to viewers that replay frames; 4 is what Gymnasium's own text environments declare.
    metadata: dict[str, Any] = {"render_modes": ["ansi"], "render_fps": 4}
    config_class: ClassVar[type[ToolEnvConfig]] = ToolEnvConfig
    instructions: ClassVar[str] = "Solve the user's task."
    """First paragraph of the default system prompt; the tool list and the answer format follow it."""

    def __init__(
        self,
        config: ToolEnvConfig | None = None,
        *,
        tokenizer: Tokenizer | str = DEFAULT_TOKENIZER,
        render_mode: str | None = None,
        context_policy: ContextPolicy | None = None,
        **overrides: Any,
    ) -> None:
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or one of {self.metadata['render_modes']}, got {render_mode!r}")
        base = config.model_dump() if config is not None else {}
        self.config = self.config_class.model_validate({**base, **overrides})
        self.context_policy: ContextPolicy = _context_policy(self.config.context, context_policy)
        """Keeps the context under its budget (``envs.context``); `Unbounded` without one."""
        self.tokenizer: Tokenizer = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.formatter = ChatFormatter(self.tokenizer)
        self.render_mode = render_mode
        # gymnasium types a Sequence space's samples as tuples; stacked (stack=True), they are arrays
        self.observation_space = spaces.Sequence(  # type: ignore[assignment]
            spaces.Discrete(self.tokenizer.vocab_size), stack=True
        )
        self.action_space = spaces.Sequence(spaces.Discrete(self.tokenizer.vocab_size), stack=True)
        self._episode: _Episode[TaskT] | None = None
        self.tool_executor: ToolExecutor | None = None
        """Answers the tool calls instead of the episode's registry when set (offline replay answers a logged
        prefix's calls with their recorded results this way); it must return a ``ToolResult`` for any call."""

    # ----------------------------------------------------------------------------------------------------------------
    # Hooks for subclasses
    # ----------------------------------------------------------------------------------------------------------------

    def make_task(self, rng: np.random.Generator) -> TaskT:
        """A new task, drawn only from ``rng`` (so that the episode seed reproduces it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_task(rng)")

    def user_prompt(self, task: TaskT) -> str:
        """The user message that states the task."""
        raise NotImplementedError(f"{type(self).__name__} must implement user_prompt(task)")

    def score(self, task: TaskT, answer: str) -> float | Score:
        """The reward for the final answer (the text inside ``<answer>…</answer>``, stripped)."""
        raise NotImplementedError(f"{type(self).__name__} must implement score(task, answer)")

    def tools(self, task: TaskT) -> Iterable[Tool | Callable[..., Any]]:
        """The tools of this episode (plain functions are wrapped with ``@tool``)."""
        return ()

    def system_prompt(self, task: TaskT) -> str:
        """The system message ("" for none): ``instructions``, then the tools and the call/answer format."""
        return system_prompt_with_tools(self.instructions, self.registry.schemas())

    def scripted_turns(self, task: TaskT) -> list[str]:
        """The assistant turns (text, without ``<|im_end|>``) of a reference solution: the oracle that
        `ScriptedPolicy` plays, for demos, supervised warm starts and tests."""
        raise NotImplementedError(f"{type(self).__name__} has no scripted solution (define scripted_turns(task))")

    def scripted_summary(self, task: TaskT, played: int) -> str:
        """The reference solution's summary after its first ``played`` turns, when the context policy asks for one:
        by default what those turns did."""
        done = "\n".join(f"- {turn}" for turn in self.scripted_turns(task)[:played])
        return f"So far I have done this:\n{done}"

    def drill_document(self, rng: np.random.Generator, tokens: int) -> Trajectory:
        """A document of about ``tokens`` tokens, drawn only from ``rng``, that drills in isolation the one skill the
        task turns on (loss on its assistant segments): the warm start's ``drill`` stages (`app/warm_start.py`) learn it
        from fresh documents before the episodes' layout, which a tiny policy does not learn it from. Optional: an
        environment without a drill refuses ``warm_start.drill``."""
        raise NotImplementedError(f"{type(self).__name__} has no drill document (define drill_document(rng, tokens))")

    @classmethod
    def has_drill(cls) -> bool:
        return cls.drill_document is not ToolEnv.drill_document

    # ----------------------------------------------------------------------------------------------------------------
    # State
    # ----------------------------------------------------------------------------------------------------------------

    @property
    def env_id(self) -> str:
        return self.spec.id if self.spec is not None else type(self).__name__

    @property
    def task(self) -> TaskT:
        """The current episode's (hidden) task."""
        return self._current().task

    @property
    def registry(self) -> ToolRegistry:
        """The current episode's tools."""
        return self._current().registry

    @property
    def trajectory(self) -> Trajectory:
        """The current (or just finished) episode as token-exact segments; a new object after every reset."""
        return self._current().trajectory

    @property
    def turn(self) -> int:
        """How many assistant turns the current episode has taken."""
        return self._current().turn

    @property
    def num_tokens(self) -> int:
        """Tokens of the whole episode (every segment logged)."""
        return self._current().num_tokens

    @property
    def context_tokens(self) -> int:
        """Tokens of the current context (``num_tokens`` unless the context policy edited it)."""
        return self._current().context_tokens

    @property
    def done(self) -> bool:
        return self._current().done

    @property
    def awaiting_context_reply(self) -> bool:
        """Whether the next action replies to the context policy's request (a summary it asked for)."""
        return self._current().awaiting_reply

    @property
    def context_replies(self) -> int:
        """Turns taken so far that replied to the context policy (summary turns; they count as turns)."""
        return self._current().replies

    def _current(self) -> _Episode[TaskT]:
        if self._episode is None:
            raise ResetNeeded(f"{self.env_id}: no episode yet; call reset() first")
        return self._episode

    # ----------------------------------------------------------------------------------------------------------------
    # Gymnasium API
    # ----------------------------------------------------------------------------------------------------------------

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[np.ndarray, dict[str, Any]]:
        """Start an episode; returns the prompt ids. ``options`` may set ``group_id`` and ``policy_version``.

        Without ``seed`` the episode seed is drawn from ``np_random``; either way it is recorded in the trajectory,
        and ``reset(seed=trajectory.seed)`` rebuilds the same task.
        """
        super().reset(seed=seed)
        options = dict(options or {})
        unknown = sorted(set(options) - set(RESET_OPTIONS))
        if unknown:
            raise ValueError(f"{self.env_id}: unknown reset option(s) {unknown}; known: {list(RESET_OPTIONS)}")
        episode_seed = seed if seed is not None else int(self.np_random.integers(SEED_BOUND))
        task = self.make_task(np.random.default_rng(episode_seed))
        trajectory = Trajectory(
            env_id=self.env_id,
            seed=episode_seed,
            group_id=str(options.get("group_id", "")),
            policy_version=int(options.get("policy_version", 0)),
            info={"max_turns": self.config.max_turns, "max_tokens": self.config.max_tokens},
        )
        episode = _Episode(task=task, registry=ToolRegistry(self.tools(task)), trajectory=trajectory, seed=episode_seed)
        self._episode = episode  # the prompt hooks may read self.registry and self.task
        try:
            self._append_prompt(episode)
        except BaseException:
            self._episode = None  # no half-built episode to step into
            raise
        observation = trajectory.token_ids().astype(np.int64)
        info = {
            "text": "".join(segment.text for segment in trajectory),
            "seed": episode_seed,
            "turn": 0,
            "num_tokens": episode.num_tokens,
            "tools": episode.registry.names,
            "finish_reason": "running",
        }
        return observation, info

    def record_logprobs(self, logprobs: Sequence[float] | np.ndarray) -> None:
        """Behaviour logprobs of the next action's tokens (one per token), recorded with it by the next ``step``."""
        episode = self._running()
        lp = np.asarray(logprobs, dtype=np.float32)
        if lp.ndim != 1:
            raise ValueError(f"logprobs must be 1-D (one per action token), got shape {lp.shape}")
        episode.pending_logprobs = lp

    def step(self, action: Action) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Take one assistant turn; see the module docstring for how it is read. Raises only for actions outside
        the action space (``ValueError``/``TypeError``) and for steps after the episode ended (``ResetNeeded``);
        in both cases the episode is left as it was."""
        episode = self._running()
        ids, logprobs = self._read_action(action, episode)
        turn = episode.turn
        content = self._content(ids)
        calls = parse_tool_calls(content)
        answer = find_answer(content)
        action_segment = self.formatter.assistant(
            ids, turn, logprobs, tool_calls=[call.to_record() for call in calls] or None
        )
        version = _action_version(action)
        if version is not None:
            action_segment = dataclasses.replace(action_segment, policy_version=version)

        # Everything is computed before the episode changes, so an error in a hook leaves the episode intact.
        if episode.num_tokens + len(action_segment) > self.config.max_tokens:  # over budget: even an answer
            return self._finish(episode, action_segment, "max_tokens", Score(0.0), calls, [], None)
        if answer.answer is not None:
            score = _as_score(self.score(episode.task, answer.answer))
            return self._finish(episode, action_segment, "answered", score, calls, [], answer.answer)
        if turn + 1 >= self.config.max_turns:
            return self._finish(episode, action_segment, "max_turns", Score(0.0), calls, [], None)
        if episode.awaiting_reply:  # this turn replies to the context policy's request (a summary): no tool runs
            return self._reply_turn(episode, action_segment)
        return self._tool_turn(episode, action_segment, content, calls)

    def end_episode(self, finish_reason: FinishReason = "aborted") -> Trajectory:
        """End the running episode from outside — e.g. the policy's context is full (``"context_limit"``): the
        episode is truncated with reward 0 and the reason is recorded in its trajectory."""
        if finish_reason in ("running", "answered"):
            raise ValueError(f"end_episode needs a truncation reason, not {finish_reason!r}")
        episode = self._running()
        episode.done = True
        episode.pending_logprobs = None
        trajectory = episode.trajectory
        trajectory.reward = 0.0
        trajectory.finish_reason = finish_reason
        return trajectory

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self._episode is None:
            return None
        return "".join(segment.text for segment in self._episode.trajectory)

    # ----------------------------------------------------------------------------------------------------------------
    # Internals
    # ----------------------------------------------------------------------------------------------------------------

    def _append_prompt(self, episode: _Episode[TaskT]) -> None:
        messages = [{"role": "user", "content": self.user_prompt(episode.task)}]
        system = self.system_prompt(episode.task)
        if system:
            messages.insert(0, {"role": "system", "content": system})
        for segment in self.formatter.prompt(messages):
            episode.append(segment)
        if episode.num_tokens > self.config.max_tokens:
            raise ValueError(
                f"{self.env_id}: the prompt has {episode.num_tokens} tokens, more than max_tokens="
                f"{self.config.max_tokens}; raise max_tokens"
            )
        if self.context_policy.over_budget(episode.num_tokens):
            raise ValueError(
                f"{self.env_id}: the prompt has {episode.num_tokens} tokens, more than context.max_context_tokens="
                f"{self.context_policy.max_context_tokens}; raise it"
            )

    def _running(self) -> _Episode[TaskT]:
        episode = self._current()
        if episode.done:
            reason = episode.trajectory.finish_reason
            raise ResetNeeded(f"{self.env_id}: the episode has ended ({reason}); call reset() before step()")
        return episode

    def _read_action(self, action: Action, episode: _Episode[TaskT]) -> tuple[np.ndarray, np.ndarray | None]:
        logprobs = episode.pending_logprobs
        if isinstance(action, Mapping):
            unknown = sorted(set(action) - {"token_ids", "logprobs", "policy_version"})
            if unknown or "token_ids" not in action:
                raise ValueError(
                    'a dict action has the keys "token_ids" and optionally "logprobs" and "policy_version"; got '
                    f"{sorted(action)}"
                )
            if action.get("logprobs") is not None:
                if logprobs is not None:
                    raise ValueError("logprobs given twice: by record_logprobs() and in the action")
                logprobs = np.asarray(action["logprobs"], dtype=np.float32)
            action = action["token_ids"]
        ids = np.asarray(action)
        if ids.ndim != 1:
            raise ValueError(f"an action is a 1-D sequence of token ids, got shape {ids.shape}")
        if ids.size and not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"an action holds integer token ids, got dtype {ids.dtype}")
        vocab_size = self.tokenizer.vocab_size
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = ids[(ids < 0) | (ids >= vocab_size)][:8].tolist()
            raise ValueError(f"token ids outside the action space [0, {vocab_size}): {bad}")
        if logprobs is not None and logprobs.shape != ids.shape:
            raise ValueError(f"{logprobs.shape[0]} logprobs for an action of {ids.shape[0]} tokens")
        return ids.astype(np.int32), logprobs

    def _content(self, ids: np.ndarray) -> str:
        """The text of a turn without its final stop token (which is not part of what the assistant said)."""
        return self.tokenizer.decode(ids[:-1] if self.formatter.ends_turn(ids) else ids)

    def _observation(
        self,
        results: list[ToolResult],
        content: str,
        turn: int,
        *,
        closes_turn: bool,
        add_generation_prompt: bool = True,
    ) -> Segment:
        if results:
            segment = self.formatter.tool_observation(
                [result.content for result in results],
                turn,
                add_generation_prompt,
                tool_calls=[result.to_record() for result in results],
            )
        else:
            correction = self._correction(content, self.registry)
            segment = self.formatter.observation("user", correction, turn, add_generation_prompt)
        return segment if closes_turn else self.formatter.closing(segment)

    # ----------------------------------------------------------------------------------------------------------------
    # A turn past the env's own rules: its tools and the context policy's plan (envs.context), or a reply to the policy
    # ----------------------------------------------------------------------------------------------------------------

    def _tool_turn(
        self, episode: _Episode[TaskT], action_segment: Segment, content: str, calls: list[ToolCall | ToolCallError]
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """A turn answered by its tool calls (or a correction), then by what the context policy plans."""
        turn, closes_turn = episode.turn, self.formatter.ends_turn(action_segment.token_ids)
        execute = self.tool_executor or episode.registry.call
        results = [execute(call) for call in calls]
        observation = self._observation(results, content, turn, closes_turn=closes_turn)
        plan = self.context_policy.plan(episode.view(self.formatter), (action_segment, observation))
        if plan.messages:  # the observation hands over to the policy's messages, which end with the generation prompt
            observation = self._observation(
                results, content, turn, closes_turn=closes_turn, add_generation_prompt=False
            )
        draft = episode.draft().log_turn(action_segment, [observation], plan)  # tried before anything changes
        if self.context_policy.over_budget(draft.context_tokens):  # it cannot be kept under: the turn is the last
            return self._finish(episode, action_segment, "context_limit", Score(0.0), calls, results, None)
        if draft.num_tokens > self.config.max_tokens:  # what the plan logs (placeholders...) counts
            return self._finish(episode, action_segment, "max_tokens", Score(0.0), calls, results, None)
        return self._commit(episode, action_segment, [observation], plan, calls, results)

    def _reply_turn(
        self, episode: _Episode[TaskT], reply: Segment
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """The turn that replies to the context policy's request: the policy's plan takes it (a summary replaces the
        turns so far, then the episode resumes)."""
        plan = self.context_policy.plan_reply(episode.view(self.formatter), reply)
        draft = episode.draft().log_turn(reply, [], plan)
        # the two budgets in the opposite order to a tool turn's, as the summary turn always checked them (so that
        # episodes stay what they were): a reply past both ends at max_tokens
        if draft.num_tokens > self.config.max_tokens:
            return self._finish(episode, reply, "max_tokens", Score(0.0), [], [], None)
        if self.context_policy.over_budget(draft.context_tokens):
            return self._finish(episode, reply, "context_limit", Score(0.0), [], [], None)
        return self._commit(episode, reply, [], plan, [], [])

    def _commit(
        self,
        episode: _Episode[TaskT],
        action_segment: Segment,
        observations: list[Segment],
        plan: ContextPlan,
        calls: list[ToolCall | ToolCallError],
        results: list[ToolResult],
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """Log the turn (checked on a draft) and return its step: the ids to append, or the whole new context."""
        before = [*episode.context, len(episode.trajectory)]  # the context the action ends
        edits = len(episode.trajectory.edits)
        episode.log_turn(action_segment, observations, plan)
        episode.turn += 1
        episode.pending_logprobs = None
        if episode.awaiting_reply:
            episode.replies += 1
        episode.awaiting_reply = plan.asks
        appended = [*observations, *plan.messages]
        text = "".join(segment.text for segment in appended)
        info = self._step_info(episode, action_segment, text, calls, results, None, "running")
        if plan.edits_context:
            return self._changed_context(episode, before, edits, info)
        ids = np.concatenate([segment.token_ids for segment in appended] or [np.zeros(0, np.int32)])
        return ids.astype(np.int64), 0.0, False, False, info

    @staticmethod
    def _changed_context(
        episode: _Episode[TaskT], before: list[int], edits: int, info: dict[str, Any]
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        """The step's result after edits: the whole new context, and ``info["context_edit"]`` (``ContextChange``;
        ``before``: the context up to this step's action, ``edits``: the number of edits before this step)."""
        trajectory = episode.trajectory
        change = ContextChange(
            kept_tokens(trajectory, before, episode.context), episode.context_tokens, tuple(trajectory.edits[edits:])
        )
        info["context_edit"] = change.to_record()
        return episode.context_ids(), 0.0, False, False, info

    @staticmethod
    def _correction(content: str, registry: ToolRegistry) -> str:
        """The user message for a turn that neither called a tool nor answered."""
        answer_format = f"{ANSWER_OPEN}...{ANSWER_CLOSE}"
        if find_answer(content).unclosed:
            return f"Error: your answer is missing its closing {ANSWER_CLOSE}. Write it as {answer_format}."
        if not len(registry):
            return f"Error: your reply has no answer. Give the final answer as {answer_format}."
        return (
            "Error: your reply has neither a tool call nor an answer. Call a tool with "
            '<tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call> '
            f"or give the final answer as {answer_format}."
        )

    def _finish(
        self,
        episode: _Episode[TaskT],
        action_segment: Segment,
        finish_reason: FinishReason,
        score: Score,
        calls: list[ToolCall | ToolCallError],
        results: list[ToolResult],
        answer: str | None,
    ) -> tuple[np.ndarray, float, bool, bool, dict[str, Any]]:
        episode.append(action_segment)
        episode.turn += 1
        episode.pending_logprobs = None
        episode.done = True
        trajectory = episode.trajectory
        trajectory.reward = score.reward
        trajectory.finish_reason = finish_reason
        trajectory.info.update({"answer": answer, "score": dict(score.details)})
        info = self._step_info(episode, action_segment, "", calls, results, answer, finish_reason)
        info["score"] = dict(score.details)
        terminated = finish_reason == "answered"
        return np.zeros(0, dtype=np.int64), score.reward, terminated, not terminated, info

    def _step_info(
        self,
        episode: _Episode[TaskT],
        action_segment: Segment,
        observation_text: str,
        calls: list[ToolCall | ToolCallError],
        results: list[ToolResult],
        answer: str | None,
        finish_reason: FinishReason,
    ) -> dict[str, Any]:
        return {
            "turn": episode.turn - 1,
            "text": action_segment.text,
            "observation_text": observation_text,
            "tool_calls": [call.to_record() for call in calls],
            "tool_results": [result.to_record() for result in results],
            "answer": answer,
            "num_tokens": episode.num_tokens,
            "finish_reason": finish_reason,
        }


def _context_policy(config: ContextConfig | None, policy: ContextPolicy | None) -> ContextPolicy:
    """The env's context policy: the one given, the one ``config`` builds, or `Unbounded`."""
    if config is not None and policy is not None:
        raise ValueError("give the context policy as config.context or as context_policy, not both")
    if policy is not None:
        return policy
    return config.build() if config is not None else Unbounded()


def tool_instructions(registry: ToolRegistry) -> str:
    """How to call the registry's tools and how to answer (Qwen-style: the schemas as JSON lines in <tools>)."""
    return schema_instructions(registry.schemas())


def system_prompt_with_tools(instructions: str, schemas: Sequence[Mapping[str, Any]]) -> str:
    """A system message as every ``ToolEnv`` writes it: ``instructions``, then the tools and the call/answer format."""
    return f"{instructions}\n\n{schema_instructions(schemas)}"


def schema_instructions(schemas: Sequence[Mapping[str, Any]]) -> str:
    """``tool_instructions`` for tools given by their OpenAI function-calling schemas (what a chat request's
    ``tools`` holds), so that a served policy reads its tools as it did in training."""
    answer = f"Give the final answer as {ANSWER_OPEN}...{ANSWER_CLOSE}."
    if not schemas:
        return answer
    lines = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
    return (
        f"Tools:\n<tools>\n{lines}\n</tools>\n"
        'Call a tool with <tool_call>{"name": <tool name>, "arguments": <JSON object>}</tool_call>; '
        f"the result comes back in <tool_response> tags. {answer}"
    )


def _as_score(value: float | Score) -> Score:
    score = value if isinstance(value, Score) else Score(value)
    reward = float(score.reward)
    if not math.isfinite(reward):
        raise ValueError(f"score() must return a finite reward, got {score.reward!r}")
    return Score(reward, score.details)


def _action_version(action: Action) -> int | None:
    """The policy version a dict action says sampled it (None: not said)."""
    version = action.get("policy_version") if isinstance(action, Mapping) else None
    if version is not None and (isinstance(version, bool) or not isinstance(version, int | np.integer)):
        raise TypeError(f"an action's policy_version is an integer, got {version!r}")
    return None if version is None else int(version)
