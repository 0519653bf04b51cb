"""The rollout loop: groups share one prompt capture, trajectories are token-exact, groups reach the store as each
finishes, context limits end episodes explicitly, and a failure mid-group leaves no part of that group stored."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import sqlite_utils
import torch

from longstraw_agents.envs import (
    EASY_CALCULATOR_KWARGS,
    EvictToolOutputs,
    SummarizeTurns,
    SummaryTurn,
    ToolEnv,
    unwrap_tool_env,
)
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.rollout import (
    ContextLimitError,
    RolloutLimits,
    make_env_factory,
    rollout_group,
    rollout_groups,
)
from longstraw_agents.sampler import OpenAISampler, SamplerError, SamplingConfig
from longstraw_agents.store import Store
from longstraw_agents.tokenizer import load_tokenizer
from longstraw_agents.torch_sampler import TorchSampler

ENV_ID = "LongStraw/Calculator-v0"
ENV_KWARGS = {**EASY_CALCULATOR_KWARGS, "max_turns": 2}
MAX_NEW_TOKENS = 16
G = 3


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("longstraw-bpe")


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", vocab_size=tokenizer.vocab_size, hidden=32, layers=1)


def make_sampler(model, tokenizer, policy_version: int = 0, temperature: float = 1.0) -> TorchSampler:
    config = SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=temperature, seed=0)
    return TorchSampler(model, [tokenizer.eos_token_id], config, policy_version=policy_version)


class Recorder:
    """Wraps a TorchSampler: counts captures and stepped tokens, keeps the handles of each fork and every
    generation per handle, and runs ``before_generate`` before each generation."""

    def __init__(self, sampler: TorchSampler, before_generate=None):
        self.sampler = sampler
        self.before_generate = before_generate
        self.captures = 0
        self.stepped_tokens = 0
        self.forks: list[tuple[list, list]] = []  # (handles, their states right after the fork)
        self.generations: dict[int, list] = {}
        engine = sampler.engine
        capture, step = engine.capture, engine.step

        def counted_capture(ids, *args, **kwargs):
            self.captures += 1
            self.stepped_tokens += len(ids)
            return capture(ids, *args, **kwargs)

        def counted_step(state, ids, *args, **kwargs):
            self.stepped_tokens += len(ids)
            return step(state, ids, *args, **kwargs)

        engine.capture, engine.step = counted_capture, counted_step

    @property
    def policy_version(self) -> int:
        return self.sampler.policy_version

    def fork(self, prompt_ids, n):
        handles = self.sampler.fork(prompt_ids, n)
        self.forks.append((handles, [h.state for h in handles]))
        return handles

    def generate(self, handle, max_new_tokens=None):
        if self.before_generate is not None:
            self.before_generate()
        generation = self.sampler.generate(handle, max_new_tokens)
        self.generations.setdefault(id(handle), []).append(generation)
        return generation

    def append(self, handle, ids):
        self.sampler.append(handle, ids)

    def num_tokens(self, handle):
        return self.sampler.num_tokens(handle)


class RecordingFactory:
    """An env factory that keeps every environment it made; ``max_turns[k]`` (when given) is the turn limit of the
    k-th environment it makes, so that members and groups end at different turns (the prompt is the same)."""

    def __init__(self, factory, max_turns: list[int] | None = None):
        self.factory = factory
        self.max_turns = max_turns
        self.envs: list[ToolEnv] = []

    def __call__(self):
        if self.max_turns is None:
            env = self.factory()
        else:
            env = make_env_factory(ENV_ID, {**ENV_KWARGS, "max_turns": self.max_turns[len(self.envs)]})()
        self.envs.append(unwrap_tool_env(env))
        return env


class PerMember:
    """A TorchSampler seen through the plain ``Sampler`` protocol (no ``generate_batch``), as an HTTP sampler is."""

    def __init__(self, sampler: TorchSampler):
        self.sampler = sampler
        self.policy_version = sampler.policy_version
        self.fork, self.generate = sampler.fork, sampler.generate
        self.append, self.num_tokens = sampler.append, sampler.num_tokens


def test_every_live_member_of_every_group_generates_its_turn_in_one_batch(tokenizer):
    """A batched sampler gets each turn of all members of all groups in one call; the episodes are the ones the
    member-by-member loop plays (fp64: same seeds, same tokens)."""
    model = tiny_model("llama", vocab_size=tokenizer.vocab_size, hidden=32, layers=1, dtype=torch.float64)
    factory = RecordingFactory(make_env_factory(ENV_ID, ENV_KWARGS), max_turns=[1, 2, 2, 2, 2, 2])
    sampler = make_sampler(model, tokenizer)
    widths: list[int] = []
    generate_batch = sampler.generate_batch

    def recorded(handles, max_new_tokens=None):
        widths.append(len(handles))
        return generate_batch(handles, max_new_tokens)

    sampler.generate_batch = recorded  # type: ignore[method-assign]
    batched = rollout_groups(factory, sampler, [3, 4], G, RolloutLimits(16), progress=False)
    factory.envs.clear()
    one_by_one = rollout_groups(factory, PerMember(make_sampler(model, tokenizer)), [3, 4], G, RolloutLimits(16))
    assert widths == [2 * G, 2 * G - 1]  # the member whose episode ended after turn 1 is not asked again
    for group_b, group_m in zip(batched, one_by_one, strict=True):
        for b, m in zip(group_b, group_m, strict=True):
            assert b.token_ids().tolist() == m.token_ids().tolist() and b.finish_reason == m.finish_reason
            np.testing.assert_allclose(b.render().logprobs, m.render().logprobs, atol=1e-6)


def test_a_group_shares_one_prompt_capture_and_each_trajectory_is_the_handles_history(model, tokenizer):
    recorder = Recorder(make_sampler(model, tokenizer))
    factory = make_env_factory(ENV_ID, ENV_KWARGS)
    trajectories = rollout_group(factory, recorder, G, seed=11, group_id="g-test", limits=RolloutLimits(16))

    assert recorder.captures == 1
    [(handles, states)] = recorder.forks
    assert len(handles) == G and all(state is states[0] for state in states)
    prompt = states[0].num_tokens
    for handle, trajectory in zip(handles, trajectories, strict=True):
        ids = trajectory.token_ids()
        assert ids.tolist() == handle.history
        assert recorder.num_tokens(handle) == len(ids)
        assert trajectory.finish_reason != "running"
    # No re-prefill: the prompt is run once, every later token once per member.
    assert recorder.stepped_tokens == prompt + sum(len(h.history) - prompt for h in handles)


def test_assistant_segments_carry_the_sampled_ids_and_behaviour_logprobs(model, tokenizer):
    temperature = 0.7
    recorder = Recorder(make_sampler(model, tokenizer, policy_version=5, temperature=temperature))
    factory = make_env_factory(ENV_ID, ENV_KWARGS)
    groups = rollout_groups(factory, recorder, [3, 4], G, RolloutLimits(16), group_prefix="step7-g", progress=False)

    assert [[t.group_id for t in group] for group in groups] == [["step7-g0"] * G, ["step7-g1"] * G]
    for (handles, _), group, seed in zip(recorder.forks, groups, [3, 4], strict=True):
        for handle, trajectory in zip(handles, group, strict=True):
            assert trajectory.env_id == ENV_ID and trajectory.seed == seed and trajectory.policy_version == 5
            actions = [s for s in trajectory.segments if s.role == "assistant"]
            generations = recorder.generations[id(handle)]
            assert [a.token_ids.tolist() for a in actions] == [g.token_ids for g in generations]
            for action, generation in zip(actions, generations, strict=True):
                np.testing.assert_array_equal(action.logprobs, np.float32(generation.logprobs))
                assert action.loss_mask.all()
            assert not any(s.loss_mask.any() for s in trajectory.segments if s.role != "assistant")

    # The behaviour logprobs are the temperature-scaled log-probabilities of the stored tokens in their context.
    trajectory = groups[1][2]
    rendered = trajectory.render()
    with torch.no_grad():
        logits = model(torch.as_tensor(rendered.token_ids[None, :-1], dtype=torch.long)).logits[0].double()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    positions = np.flatnonzero(rendered.loss_mask)
    expected = logprobs[positions - 1, rendered.token_ids[positions]].numpy()
    np.testing.assert_allclose(rendered.logprobs[positions], expected, atol=1e-4)


def test_groups_are_stored_whole_as_each_finishes(model, tokenizer, tmp_path: Path):
    """All groups play turn by turn together; a group reaches the store once all its members have ended, while
    other groups still play. A random policy never answers, so each episode lasts its env's max_turns: the first
    member of g0 ends after turn 1, the rest of g0 after turn 2, g1 after turn 3."""
    factory = RecordingFactory(make_env_factory(ENV_ID, ENV_KWARGS), max_turns=[1, 2, 2, 3, 3, 3])
    store = Store.open(tmp_path / "trajectories.db")
    run_id = store.add_run(config={"test": True}, model="tiny", tokenizer=tokenizer.name)
    seen: list[tuple[int, int, int]] = []

    def check_store():
        # Before every generation, the store holds exactly the episodes of the groups that have ended so far.
        groups = [factory.envs[k : k + G] for k in range(0, len(factory.envs), G)]
        whole = sum(G for group in groups if all(env.done for env in group))
        seen.append((store.count(), whole, sum(env.done for env in factory.envs)))

    recorder = Recorder(make_sampler(model, tokenizer, policy_version=2), before_generate=check_store)
    groups = rollout_groups(factory, recorder, [5, 6], G, RolloutLimits(16), store=store, run_id=run_id, progress=False)

    assert [[len(recorder.generations[id(h)]) for h in handles] for handles, _ in recorder.forks] == [
        [1, 2, 2],
        [3, 3, 3],
    ]
    assert all(stored == whole for stored, whole, _ in seen)
    assert any(stored < done for stored, _, done in seen)  # a finished member waits for the rest of its group
    assert any(stored == G for stored, _, _ in seen)  # written during the rollout, not after it
    assert store.count() == 2 * G and store.count("run_id = ?", [run_id]) == 2 * G
    stored = list(store.episodes())
    for trajectory in (t for group in groups for t in group):
        assert trajectory in stored  # token-exact: ids, masks, logprobs, text, tool calls and metadata
    assert {t.group_id for t in stored} == {"g0", "g1"} and {t.policy_version for t in stored} == {2}
    store.close()


def test_a_tight_context_ends_episodes_explicitly_and_the_store_records_why(model, tokenizer, tmp_path: Path):
    prompt_len = len(unwrap_tool_env(make_env_factory(ENV_ID, ENV_KWARGS)()).reset(seed=1)[0])
    max_context = prompt_len + MAX_NEW_TOKENS + 8  # room for one turn, not for its observation
    limits = RolloutLimits(MAX_NEW_TOKENS, max_context)
    factory = make_env_factory(ENV_ID, {**ENV_KWARGS, "max_turns": 3}, limits)
    with Store.open(tmp_path / "trajectories.db") as store:
        groups = rollout_groups(factory, make_sampler(model, tokenizer), [1], G, limits, store=store, progress=False)
    db = sqlite_utils.Database(tmp_path / "trajectories.db")  # any SQLite reader can read the store
    rows = list(db.query("SELECT finish_reason, reward, num_tokens FROM episodes"))
    assert len(rows) == G
    for row, trajectory in zip(rows, groups[0], strict=True):
        assert row["finish_reason"] in ("context_limit", "max_tokens")
        assert row["finish_reason"] == trajectory.finish_reason and row["reward"] == 0.0
        assert row["num_tokens"] == trajectory.num_tokens <= max_context


def test_envs_whose_budget_exceeds_the_model_context_are_refused(model, tokenizer):
    """An env allowed more tokens than the model's context would feed the sampler past it (observations are
    appended unchecked); the loop refuses such envs up front instead."""
    sampler = make_sampler(model, tokenizer)
    limits = RolloutLimits(MAX_NEW_TOKENS, max_context=1000)
    with pytest.raises(ValueError, match="max_context"):
        rollout_group(make_env_factory(ENV_ID, ENV_KWARGS), sampler, G, 1, "g0", limits)  # env budget 2048
    fitted = rollout_group(make_env_factory(ENV_ID, ENV_KWARGS, limits), sampler, G, 1, "g0", limits)
    assert all(t.num_tokens <= 1000 for t in fitted)


def test_make_env_factory_caps_the_env_budget_at_the_context_and_never_raises_it():
    def budget(kwargs, max_context):
        limits = RolloutLimits(MAX_NEW_TOKENS, max_context)
        return unwrap_tool_env(make_env_factory(ENV_ID, kwargs, limits)()).config.max_tokens

    default = unwrap_tool_env(make_env_factory(ENV_ID, ENV_KWARGS)()).config.max_tokens
    assert budget(ENV_KWARGS, 500) == 500
    assert budget({**ENV_KWARGS, "max_tokens": 300}, 500) == 300
    assert budget(ENV_KWARGS, 1 << 20) == default  # the env's own budget stays when the model allows more


def test_context_exactly_full_ends_with_context_limit(model, tokenizer):
    """When the context is full after an observation, the episode ends with "context_limit" before sampling."""
    factory = make_env_factory(ENV_ID, ENV_KWARGS)
    env = unwrap_tool_env(factory())
    prompt = env.reset(seed=2)[0]
    sampler = make_sampler(model, tokenizer)
    [handle] = sampler.fork(prompt.tolist(), 1)
    generation = sampler.generate(handle)
    observation = env.step({"token_ids": generation.token_ids, "logprobs": generation.logprobs})[0]
    sampler.append(handle, observation.tolist())
    full = RolloutLimits(MAX_NEW_TOKENS, max_context=sampler.num_tokens(handle))

    from longstraw_agents.rollout import play_until_done

    [trajectory] = play_until_done([env], [handle], sampler, full)
    assert trajectory.finish_reason == "context_limit" and trajectory.reward == 0.0
    assert trajectory.token_ids().tolist() == handle.history  # nothing sampled after the context filled


def test_a_failure_mid_group_stores_no_part_of_that_group(model, tokenizer, tmp_path: Path):
    # g0 ends after turn 1; in g1 one member ends after turn 1, the others would play a second turn
    factory = RecordingFactory(make_env_factory(ENV_ID, ENV_KWARGS), max_turns=[1, 1, 1, 1, 2, 2])

    def fail_once_a_member_of_the_second_group_has_finished():
        second = factory.envs[G:]
        if any(env.done for env in second):  # others of the group are still running
            raise SamplerError("server went away")

    recorder = Recorder(
        make_sampler(model, tokenizer), before_generate=fail_once_a_member_of_the_second_group_has_finished
    )
    path = tmp_path / "trajectories.db"
    with Store.open(path) as store, pytest.raises(SamplerError, match="went away"):
        rollout_groups(factory, recorder, [7, 8], G, RolloutLimits(16), store=store, progress=False)
    first, second = factory.envs[:G], factory.envs[G:]
    assert all(env.done for env in first) and 0 < sum(env.done for env in second) < G
    with Store.open(path, create=False) as store:
        stored = list(store.episodes())
    assert sorted(t.token_ids().tolist() for t in stored) == sorted(
        env.trajectory.token_ids().tolist() for env in first
    )
    assert {t.group_id for t in stored} == {"g0"}  # the finished members of g1 were not written
    with closing(sqlite3.connect(path)) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        segments = conn.execute("SELECT COUNT(*) FROM segments").fetchone()[0]
    assert segments == sum(len(t.segments) for t in stored)


def test_a_prompt_over_the_model_context_names_the_model_limit(model, tokenizer):
    sampler = make_sampler(model, tokenizer)
    factory = make_env_factory(
        ENV_ID, ENV_KWARGS, RolloutLimits(MAX_NEW_TOKENS, 16)
    )  # the env budget is capped at the context
    with pytest.raises(ContextLimitError, match="model's context limit of 16 tokens"):
        rollout_group(factory, sampler, G, 0, "g", RolloutLimits(MAX_NEW_TOKENS, 16))
    with pytest.raises(ValueError, match="raise max_tokens") as err:  # the env's own budget: its advice stands
        rollout_group(make_env_factory(ENV_ID, {**ENV_KWARGS, "max_tokens": 16}), sampler, G, 0, "g", RolloutLimits(8))
    assert not isinstance(err.value, ContextLimitError)
    # a context budget of the env's own below the model's: its advice stands, whatever max_tokens is
    kwargs = {**ENV_KWARGS, "max_tokens": 100_000, "context": {"max_context_tokens": 16}}
    with pytest.raises(ValueError, match="more than context.max_context_tokens=16") as err:
        rollout_group(
            make_env_factory(ENV_ID, kwargs, RolloutLimits(8, 4096)), sampler, G, 0, "g", RolloutLimits(8, 4096)
        )
    assert not isinstance(err.value, ContextLimitError)
    # the model's context caps a larger context budget (not max_tokens: the episode may be longer than the context)
    # and leaves room for the turn after an observation: the context less max_new_tokens
    wide = {**kwargs, "context": {"max_context_tokens": 9000}}
    capped = unwrap_tool_env(make_env_factory(ENV_ID, wide, RolloutLimits(MAX_NEW_TOKENS, 512))())
    assert capped.context_policy.max_context_tokens == 512 - MAX_NEW_TOKENS and capped.config.max_tokens == 100_000


def test_a_context_policy_capped_by_the_model_leaves_room_for_the_next_turn(model, tokenizer):
    """Capped at the whole context, an edit that fills the budget left the next turn no room (it was cut short);
    capped at the context less max_new_tokens, every turn after an edit gets its full length."""
    prompt = len(unwrap_tool_env(make_env_factory(ENV_ID, ENV_KWARGS)()).reset(seed=3)[0])
    limits = RolloutLimits(MAX_NEW_TOKENS, prompt + 3 * MAX_NEW_TOKENS)
    kwargs = {**ENV_KWARGS, "context": {"max_context_tokens": 100_000}}
    env = unwrap_tool_env(make_env_factory(ENV_ID, kwargs, limits)())
    assert env.context_policy.max_context_tokens == limits.max_context - MAX_NEW_TOKENS
    assert env.config.max_tokens == ENV_KWARGS.get("max_tokens", env.config.max_tokens)  # the episode may be longer
    with pytest.raises(ContextLimitError, match="max_new_tokens=16 leaves no room"):
        make_env_factory(ENV_ID, kwargs, RolloutLimits(MAX_NEW_TOKENS, MAX_NEW_TOKENS))()
    summary = {
        **ENV_KWARGS,
        "context": {"max_context_tokens": 100_000, "strategy": {"kind": "summary", "threshold": 500}},
    }
    limit = r"below max_context_tokens \(4\).*model's context limit of 20 tokens .* less a turn \(max_new_tokens=16\)"
    with pytest.raises(ContextLimitError, match=limit):
        make_env_factory(ENV_ID, summary, RolloutLimits(MAX_NEW_TOKENS, 20))()
    sampler = make_sampler(model, tokenizer)
    with pytest.raises(ValueError, match="leaves room for a turn"):  # an env built at the whole context is refused
        whole = {**ENV_KWARGS, "context": {"max_context_tokens": limits.max_context}}
        rollout_group(make_env_factory(ENV_ID, whole), sampler, G, 3, "g", limits)


def test_an_unreachable_server_writes_no_episode(tokenizer, tmp_path: Path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sampler = OpenAISampler(f"http://127.0.0.1:{port}", [tokenizer.eos_token_id], max_retries=1, backoff_s=0.01)
    factory = make_env_factory(ENV_ID, ENV_KWARGS)
    with Store.open(tmp_path / "trajectories.db") as store:
        with pytest.raises(SamplerError, match="after 2 attempts"):
            rollout_groups(factory, sampler, [0], 2, RolloutLimits(8), store=store, progress=False)
        assert store.count() == 0
    sampler.close()


def test_summary_turns_edit_the_context_and_each_turn_was_sampled_from_its_physical_sequence(model, tokenizer):
    """A random policy's context passes the summary threshold: its next turn is the summary, which replaces its
    turns, and the sampler resumes from the kept prompt. Every sampled token's behaviour logprob is the model's
    log-probability of it in the physical sequence the trajectory says it was generated under."""
    prompt = len(unwrap_tool_env(make_env_factory(ENV_ID, ENV_KWARGS)()).reset(seed=5)[0])
    context = {"max_context_tokens": prompt + 400, "strategy": {"kind": "summary", "threshold": prompt + 40}}
    factory = make_env_factory(ENV_ID, {**ENV_KWARGS, "max_turns": 8, "context": context})
    sampler = make_sampler(model, tokenizer)
    trajectories = rollout_group(factory, sampler, G, seed=5, group_id="g", limits=RolloutLimits(MAX_NEW_TOKENS))

    assert all(t.is_edited for t in trajectories) and all(e.kind == "summary" for t in trajectories for e in t.edits)
    for trajectory in trajectories:
        sequences = trajectory.physical_sequences()
        assert len(sequences) > 1 and all(len(s.segments) < len(trajectory.segments) for s in sequences)
        for sequence in sequences:
            rendered = trajectory.render_sequence(sequence)
            with torch.no_grad():
                logits = model(torch.as_tensor(rendered.token_ids[None, :-1], dtype=torch.long)).logits[0].double()
            positions = np.flatnonzero(rendered.loss_mask)
            expected = torch.log_softmax(logits, dim=-1)[positions - 1, rendered.token_ids[positions]].numpy()
            np.testing.assert_allclose(rendered.logprobs[positions], expected, atol=1e-4)


class PagingEnv(ToolEnv[int]):
    """Every turn is answered with the next page of a book as a tool output (a stand-in for an agent that reads a
    tool each turn: a random policy never writes a well-formed call), so evictions happen under any policy."""

    instructions = "Read the book."

    def make_task(self, rng: np.random.Generator) -> int:
        return int(rng.integers(1000))

    def user_prompt(self, task: int) -> str:
        return f"Read book {task}."

    def score(self, task: int, answer: str) -> float:
        return float(answer == str(task))

    def _observation(self, results, content, turn, *, closes_turn, add_generation_prompt=True):
        page = f"page {turn} of book {self.task}: " + "the river runs by the old mill " * 12
        segment = self.formatter.tool_observation([page], turn, add_generation_prompt)
        return segment if closes_turn else self.formatter.closing(segment)


def test_evictions_resume_sampling_from_the_kept_turn_and_each_turn_was_sampled_from_its_sequence(model, tokenizer):
    """Tool outputs evicted under a budget, the sampler resuming each member from a state the edit keeps
    (``keep_marks``; which one: tests/test_torch_sampler.py): every sampled token's behaviour logprob is the
    model's in the physical sequence the trajectory says it was generated under."""
    prompt = len(PagingEnv().reset(seed=0)[0])
    context = {"max_context_tokens": prompt + 600}

    def factory() -> ToolEnv:
        return PagingEnv(tokenizer=tokenizer, max_turns=6, context=context)

    sampler = TorchSampler(
        model, [tokenizer.eos_token_id], SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, seed=0), keep_marks=True
    )
    trajectories = rollout_group(factory, sampler, G, seed=0, group_id="g", limits=RolloutLimits(MAX_NEW_TOKENS))

    for trajectory in trajectories:
        assert trajectory.finish_reason == "max_turns" and len(trajectory.edits) >= 2
        assert {e.kind for e in trajectory.edits} == {"evict"}
        for sequence in trajectory.physical_sequences():
            rendered = trajectory.render_sequence(sequence)
            assert len(rendered.token_ids) <= prompt + 600 + MAX_NEW_TOKENS
            with torch.no_grad():
                logits = model(torch.as_tensor(rendered.token_ids[None, :-1], dtype=torch.long)).logits[0].double()
            positions = np.flatnonzero(rendered.loss_mask)
            expected = torch.log_softmax(logits, dim=-1)[positions - 1, rendered.token_ids[positions]].numpy()
            np.testing.assert_allclose(rendered.logprobs[positions], expected, atol=1e-4)


@pytest.mark.parametrize("kind", ["evict", "summary"])
def test_a_context_policy_given_as_an_object_is_capped_by_the_models_context_like_one_from_the_config(
    kind: str,
) -> None:
    """``make_env_factory`` caps the policy object itself (the config has no ``context``): its budget leaves a turn
    in the model's context, the episode's own ``max_tokens`` stays; a summary threshold that no longer fits below
    the cap is one line naming the model's limit."""
    limits = RolloutLimits(max_new_tokens=256, max_context=4096)
    policy = EvictToolOutputs(20_000) if kind == "evict" else SummarizeTurns(20_000, SummaryTurn(threshold=2_000))
    env = unwrap_tool_env(make_env_factory("LongStraw/NeedleSearch-v0", {"context_policy": policy}, limits)())
    assert type(env.context_policy) is type(policy) and env.context_policy.max_context_tokens == 4096 - 256
    assert env.config.max_tokens == unwrap_tool_env(make_env_factory("LongStraw/NeedleSearch-v0")()).config.max_tokens
    assert env.context_policy.edits_keep_most_of_the_context == (kind == "evict")  # the sampler keeps marks then
    if kind == "summary":
        too_high = SummarizeTurns(20_000, SummaryTurn(threshold=3_900))
        with pytest.raises(ContextLimitError, match=r"threshold \(3900\).*model's context limit of 4096 tokens"):
            make_env_factory("LongStraw/NeedleSearch-v0", {"context_policy": too_high}, limits)()
