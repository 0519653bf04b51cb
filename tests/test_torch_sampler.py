"""``TorchSampler`` (torch_sampler.py): behaviour logprobs equal the model's distribution, one prompt capture shared
by a group, batched and one-by-one decoding draw the same tokens, greedy / top-p / temperature draws, stop and
length finishes; storage that grows as decoding proceeds, and a fork that pauses between a prompt's chunks."""

from __future__ import annotations

import math

import pytest
import torch

from longstraw_agents.memory import MemoryTracker
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import tiny_model
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.torch_sampler import FIRST_RESERVE, BatchDecoding, TorchSampler, sample_token, sample_tokens

STOP = 7


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_5", dtype=torch.float64)


def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("batched", [False, True])
def test_generation_logprobs_match_the_models_distribution(model, batched):
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=12, seed=3), chunk_size=4)
    prompt = list(range(20, 31))
    handles = sampler.fork(prompt, 3)
    if batched:
        firsts = sampler.generate_batch(handles)
        for handle in handles:
            sampler.append(handle, [40, 41, 42])
        seconds = sampler.generate_batch(handles)
    else:
        firsts, seconds = [], []
        for handle in handles:
            firsts.append(sampler.generate(handle))
            sampler.append(handle, [40, 41, 42])  # an observation: extends the state, no re-prefill
            seconds.append(sampler.generate(handle))
    for handle, gen, gen2 in zip(handles, firsts, seconds, strict=True):
        history = prompt + gen.token_ids + [40, 41, 42] + gen2.token_ids
        assert handle.history == history and sampler.num_tokens(handle) == len(history)
        reference = full_logprobs(model, history)
        offset = len(prompt)
        for k, (token, lp) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
            assert lp == pytest.approx(float(reference[offset + k - 1, token]), abs=1e-5)
        offset = len(prompt) + len(gen.token_ids) + 3
        for k, (token, lp) in enumerate(zip(gen2.token_ids, gen2.logprobs, strict=True)):
            assert lp == pytest.approx(float(reference[offset + k - 1, token]), abs=1e-5)


def play(sampler: TorchSampler, handles, limits: list[int], batched: bool):
    """Two turns with an observation between them; per-member token limits so members leave the batch at
    different steps (and at stop tokens)."""
    turns = []
    for turn in range(2):
        if batched:
            turns.append(sampler.generate_batch(handles, limits))
        else:
            turns.append([sampler.generate(h, limit) for h, limit in zip(handles, limits, strict=True)])
        if turn == 0:
            for k, handle in enumerate(handles):
                sampler.append(handle, [60 + k, 61, 62][: 1 + k % 3])
    return turns


def test_batched_and_one_by_one_decoding_draw_the_same_tokens(model):
    """fp64: every member draws from its own generator (sampler seed, member index), so the same seeds give the
    same tokens whether members are decoded together (and drop out of the batch) or alone."""
    stops = list(range(0, 256, 16))  # frequent enough that some members stop before their limit
    config = SamplingConfig(max_new_tokens=10, temperature=0.9, top_p=0.95, seed=11)
    results = []
    for batched in (True, False):
        sampler = TorchSampler(model, stops, config, chunk_size=8)
        handles = sampler.fork(list(range(100, 125)), 4) + sampler.fork([30, 31, 32], 3)
        turns = play(sampler, handles, [10, 3, 7, 10, 1, 5, 10], batched)
        results.append((turns, [h.history for h in handles], [sampler.num_tokens(h) for h in handles]))
    (batched_turns, batched_history, batched_sizes), (alone_turns, alone_history, alone_sizes) = results
    assert batched_history == alone_history and batched_sizes == alone_sizes
    finishes = set()
    for turn_b, turn_a in zip(batched_turns, alone_turns, strict=True):
        for gb, ga in zip(turn_b, turn_a, strict=True):
            assert gb.token_ids == ga.token_ids and gb.finish_reason == ga.finish_reason
            assert gb.logprobs == pytest.approx(ga.logprobs, abs=1e-12)
            finishes.add(gb.finish_reason)
    assert finishes == {"stop", "length"}
    lengths = {len(g.token_ids) for turn in batched_turns for g in turn}
    assert len(lengths) > 2  # members left the batch at different steps


def test_static_decoding_steps_draw_what_eager_ones_draw(model):
    """``graphs=True`` (static steps: CUDA graphs on a GPU, run eagerly here) and the eager step, through members
    leaving at different steps and a second turn."""
    stops = list(range(0, 256, 16))
    config = SamplingConfig(max_new_tokens=8, temperature=0.9, seed=5)
    results = []
    for graphs in (True, False):
        sampler = TorchSampler(model, stops, config, chunk_size=8, graphs=graphs)
        handles = sampler.fork(list(range(100, 125)), 4) + sampler.fork([30, 31, 32], 2)
        results.append(play(sampler, handles, [8, 2, 5, 8, 1, 6], batched=True))
    for turn_static, turn_eager in zip(*results, strict=True):
        for static, eager in zip(turn_static, turn_eager, strict=True):
            assert static.token_ids == eager.token_ids and static.finish_reason == eager.finish_reason
            assert static.logprobs == pytest.approx(eager.logprobs, abs=1e-12)
    assert len({len(g.token_ids) for turn in results[0] for g in turn}) > 2  # members left at different steps


def test_a_members_tokens_do_not_depend_on_its_batch(model):
    config = SamplingConfig(max_new_tokens=6, seed=2)
    alone = TorchSampler(model, [STOP], config)
    together = TorchSampler(model, [STOP], config)
    [mine] = alone.fork([5, 6, 7], 1)
    [same] = together.fork([5, 6, 7], 1)
    others = together.fork([9, 9, 9, 9], 5)
    assert alone.generate_batch([mine])[0].token_ids == together.generate_batch([*others, same])[-1].token_ids


def test_sample_tokens_draws_each_row_with_its_own_generator():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    config = SamplingConfig(temperature=0.7, top_p=0.8)
    rows = [sample_token(logits[b], config, torch.Generator().manual_seed(b)) for b in range(5)]
    tokens, logprobs = sample_tokens(logits, config, [torch.Generator().manual_seed(b) for b in range(5)])
    assert tokens == [t for t, _ in rows] and logprobs == pytest.approx([lp for _, lp in rows])
    kept = torch.softmax(logits / 0.7, -1)
    for b, token in enumerate(tokens):  # inside the nucleus: the tokens whose higher-ranked mass is < top_p
        ranked = kept[b].sort(descending=True)
        before = ranked.values.cumsum(0) - ranked.values
        assert token in ranked.indices[before < 0.8].tolist()


def test_members_share_the_prompt_capture_and_diverge(model):
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=8, seed=0))
    handles = sampler.fork(list(range(10, 40)), 4)
    first = handles[0].state
    assert all(h.state is first for h in handles)  # one capture, shared
    outputs = {tuple(g.token_ids) for g in sampler.generate_batch(handles)}
    assert len(outputs) > 1  # sampling at temperature 1 diverges: every member has its own generator


def test_greedy_and_top_p_tiny_pick_the_argmax():
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    gen = torch.Generator().manual_seed(0)
    assert sample_token(logits, SamplingConfig(temperature=0.0), gen)[0] == 1
    picks = {sample_token(logits, SamplingConfig(top_p=0.01), gen)[0] for _ in range(20)}
    assert picks == {1}
    token, lp = sample_token(logits, SamplingConfig(temperature=0.5), gen)
    assert lp == pytest.approx(float(torch.log_softmax(logits.double() / 0.5, -1)[token]))


def test_stop_and_length_finish_reasons(model):
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=5, temperature=0.0))
    gen = sampler.complete([1, 2, 3])
    assert gen.finish_reason == "length" and len(gen.token_ids) == 5
    eager_stop = TorchSampler(model, [gen.token_ids[0]], SamplingConfig(max_new_tokens=5, temperature=0.0))
    stopped = eager_stop.complete([1, 2, 3])
    assert stopped.finish_reason == "stop" and stopped.token_ids == gen.token_ids[:1]
    with pytest.raises(ValueError):
        TorchSampler(model, [])
    with pytest.raises(ValueError):
        sampler.fork([], 2)


# --- edited contexts ----------------------------------------------------------------------------------------------
def count_forward_tokens(sampler: TorchSampler, monkeypatch) -> list[int]:
    """Every token the engine evaluates from now on (forward and state-only pieces), as a list of piece sizes."""
    pieces: list[int] = []
    forward, entries = sampler.engine.kit.forward, sampler.engine.kit.state_entries

    def counted_forward(ids, start, contexts):
        pieces.append(int(ids.shape[0]))
        return forward(ids, start, contexts)

    def counted_entries(ids, start, contexts):
        pieces.append(int(ids.shape[0]))
        return entries(ids, start, contexts)

    monkeypatch.setattr(sampler.engine.kit, "forward", counted_forward)
    monkeypatch.setattr(sampler.engine.kit, "state_entries", counted_entries)
    return pieces


@pytest.mark.parametrize("keep_marks", [True, False])
def test_an_edited_context_resumes_from_the_last_state_it_keeps(model, monkeypatch, keep_marks):
    """After an edit that keeps the prompt and the first turn, the member's next-token distribution is a fresh
    forward's over the new context. With marks only the tokens after the kept turn's observation are evaluated,
    without them everything after the prompt."""
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=5, seed=1), chunk_size=4, keep_marks=keep_marks)
    prompt = list(range(20, 31))
    [handle] = sampler.fork(prompt, 1)
    sampler.generate(handle)
    sampler.append(handle, [40, 41, 42])
    kept = len(handle.history)
    sampler.generate(handle)
    sampler.append(handle, [43, 44, 45, 46])
    assert len(handle.marks) == (5 if keep_marks else 1)  # prompt, two turns, two observations
    edited = handle.history[:kept] + [50, 51] + handle.history[kept + 2 :]  # two tokens replaced after the kept ones

    pieces = count_forward_tokens(sampler, monkeypatch)
    sampler.replace(handle, edited, kept)

    assert sum(pieces) == len(edited) - (kept if keep_marks else len(prompt))
    assert handle.history == edited and sampler.num_tokens(handle) == len(edited)
    assert torch.allclose(torch.log_softmax(handle.next_logits.double(), -1), full_logprobs(model, edited)[-1])
    generation = sampler.generate(handle)  # and sampling goes on from there
    reference = full_logprobs(model, edited + generation.token_ids)
    for k, (token, lp) in enumerate(zip(generation.token_ids, generation.logprobs, strict=True)):
        assert lp == pytest.approx(float(reference[len(edited) + k - 1, token]), abs=1e-6)


def test_an_eviction_right_after_a_turn_resumes_from_that_turns_end(model, monkeypatch):
    """An eviction keeps everything up to the output it removes: the state after the turn that asked for it."""
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=4, seed=3), chunk_size=4, keep_marks=True)
    [handle] = sampler.fork(list(range(20, 31)), 1)
    sampler.generate(handle)
    kept = len(handle.history)
    sampler.append(handle, [40, 41, 42, 43, 44])  # the output that will go
    sampler.generate(handle)
    edited = handle.history[:kept] + [60] + handle.history[kept + 5 :]  # the output replaced by a placeholder
    pieces = count_forward_tokens(sampler, monkeypatch)
    sampler.replace(handle, edited + [70, 71], kept)
    assert sum(pieces) == len(edited) + 2 - kept
    assert torch.allclose(
        torch.log_softmax(handle.next_logits.double(), -1), full_logprobs(model, edited + [70, 71])[-1]
    )


def test_members_resuming_from_one_mark_capture_what_they_share_once(model, monkeypatch):
    """Two members whose edits keep only the group's prompt and agree on the next 9 tokens: those are evaluated
    once for both, then each its own tail; batched decoding goes on from there with the model's distribution."""
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=4, seed=2), chunk_size=4)
    prompt = list(range(20, 31))
    handles = sampler.fork(prompt, 2)
    sampler.generate_batch(handles)
    contexts = [prompt + list(range(60, 69)) + [70, 71], prompt + list(range(60, 69)) + [72, 73, 74]]

    pieces = count_forward_tokens(sampler, monkeypatch)
    sampler.replace_batch(handles, contexts, [len(prompt), len(prompt)])

    assert sum(pieces) == 9 + 2 + 3
    for handle, context in zip(handles, contexts, strict=True):
        assert handle.history == context
        assert torch.allclose(torch.log_softmax(handle.next_logits.double(), -1), full_logprobs(model, context)[-1])
    generations = sampler.generate_batch(handles)  # the batched decoder still reads the shared prompt once
    for context, generation in zip(contexts, generations, strict=True):
        reference = full_logprobs(model, context + generation.token_ids)
        for k, (token, lp) in enumerate(zip(generation.token_ids, generation.logprobs, strict=True)):
            assert lp == pytest.approx(float(reference[len(context) + k - 1, token]), abs=1e-6)


def test_members_of_two_groups_resuming_from_one_prompt_decode_together(model):
    """Two groups forked apart from the same prompt (held-out episodes of a task whose prompt does not vary), edited
    in one batch back to that prompt: both resume from the first group's mark, so the second member's own prompt
    capture is no longer in its state (the decoder refused the batch). It shares the first member's prompt instead,
    and decodes with the model's distribution."""
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=4, seed=2), chunk_size=4)
    prompt = list(range(20, 31))
    handles = [*sampler.fork(prompt, 1), *sampler.fork(prompt, 1)]
    sampler.generate_batch(handles)
    contexts = [prompt + [60, 61, 62], prompt + [63, 64]]
    sampler.replace_batch(handles, contexts, [len(prompt), len(prompt)])
    assert handles[0].prefix is not None and handles[1].prefix is handles[0].prefix
    generations = sampler.generate_batch(handles)
    for context, generation in zip(contexts, generations, strict=True):
        reference = full_logprobs(model, context + generation.token_ids)
        for k, (token, lp) in enumerate(zip(generation.token_ids, generation.logprobs, strict=True)):
            assert lp == pytest.approx(float(reference[len(context) + k - 1, token]), abs=1e-6)


def test_members_with_the_same_tokens_share_their_resumed_capture(model, monkeypatch):
    """Marks of different members holding the same tokens (the same observation appended to both) are one: the
    edited contexts after them are captured once when they agree."""
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=4, seed=2), chunk_size=4, keep_marks=True)
    prompt = list(range(20, 31))
    handles = sampler.fork(prompt, 2)
    for handle in handles:
        sampler.append(handle, [40, 41, 42])
    assert handles[0].marks[-1] is not handles[1].marks[-1]
    kept = len(prompt) + 3
    context = prompt + [40, 41, 42] + [80, 81, 82, 83]
    pieces = count_forward_tokens(sampler, monkeypatch)
    sampler.replace_batch(handles, [context, context], [kept, kept])
    assert sum(pieces) == 3 + 1 + 1  # the shared run once, then each member its last token
    with pytest.raises(ValueError, match="the same handle twice"):
        sampler.replace_batch([handles[0], handles[0]], [context, context], [kept, kept])


def test_an_edit_that_does_not_keep_what_it_claims_is_refused(model):
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=3, seed=2), chunk_size=4)
    [handle] = sampler.fork(list(range(20, 31)), 1)
    with pytest.raises(ValueError, match="does not start with the 11 tokens it is said to keep"):
        sampler.replace(handle, [99] + list(range(21, 31)) + [5], 11)
    with pytest.raises(ValueError, match="must hold new tokens"):
        sampler.replace(handle, list(range(20, 31)), 11)
    sampler.replace(handle, [99, 98, 97], 0)  # an edit of the prompt itself: captured from nothing
    assert handle.prefix is None and sampler.num_tokens(handle) == 3


# --- storage grows as decoding proceeds ----------------------------------------------------------------------------


def test_a_long_token_limit_reserves_nothing_up_front(model):
    """A million-token limit costs what is decoded, not a million positions per member (the server's case)."""
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=1_000_000, seed=1))
    per_token = state_size(model.config, torch.float64).bytes_per_token
    with MemoryTracker() as memory:
        decoding = BatchDecoding(sampler, sampler.fork(list(range(20, 40)), 4), keep_states=False)
        for _ in range(3):
            decoding.step()
    assert not decoding.done
    assert memory.peak_bytes < 4 * 1_000 * per_token  # reserved up front it would be 4 * 1e6 positions: 2 GB


def test_a_turn_decoded_token_by_token_grows_its_storage_by_doubling():
    """``generate`` (an ``Engine.step`` per token) reserves as many positions again as it decoded when its arena is
    full: a handful of arenas for 160 tokens, not one per token, and never much more room than it used, though the
    sampler's limit is a million."""
    small = tiny_model("llama", dtype=torch.float64, hidden=16, layers=1)  # 160 steps: the smallest model
    sampler = TorchSampler(small, [STOP], SamplingConfig(max_new_tokens=1_000_000, temperature=0.0))
    [handle] = sampler.fork([20, 21, 22], 1)
    generation = sampler.generate(handle, 160)
    assert len(generation.token_ids) == 160  # greedy never draws STOP here: the whole limit was decoded
    growing = next(i for i, layer in enumerate(sampler.engine.adapter.layers) if layer.mixer.grows)
    arenas = {id(block.arena): block.arena for block in handle.state.blocks(growing)}.values()
    assert len(arenas) <= 2 + math.ceil(math.log2(160 / FIRST_RESERVE)) + 1  # the prompt's, then doubling
    assert sum(arena.capacity for arena in arenas) <= 2 * handle.state.num_tokens + FIRST_RESERVE


def test_a_batch_decoded_without_states_draws_what_generate_batch_draws(model):
    """``BatchDecoding(keep_states=False)`` (a server's answers) drops a member before the step after its last
    token; the draws are the ones ``generate_batch`` makes, member by member."""
    config = SamplingConfig(max_new_tokens=8, seed=4)
    kept = TorchSampler(model, [STOP], config)
    expected = kept.generate_batch(kept.fork([20, 21, 22], 3), [5, 2, 8])
    served = TorchSampler(model, [STOP], config)
    handles = served.fork([20, 21, 22], 3)
    decoding = BatchDecoding(served, handles, [5, 2, 8], keep_states=False)
    steps = 0
    while not decoding.done:
        decoding.step()
        steps += 1
    generations = decoding.generations()
    for generation, reference in zip(generations, expected, strict=True):
        assert generation.token_ids == reference.token_ids and generation.finish_reason == reference.finish_reason
        assert generation.logprobs == pytest.approx(reference.logprobs, abs=1e-12)
    assert steps == max(len(g.token_ids) for g in expected)
    assert all(h.history == [20, 21, 22] and h.state.num_tokens == 3 for h in handles)  # nothing written back


def test_a_fork_that_pauses_between_chunks_computes_what_fork_computes(model):
    sampler = TorchSampler(model, [STOP], SamplingConfig(), chunk_size=4)
    prompt = list(range(20, 31))  # 10 tokens captured in chunks of 4, then the last one stepped
    pauses: list[int] = []
    paused = sampler.fork_pausing(prompt, 2, lambda: pauses.append(1))
    [whole] = sampler.fork(prompt, 1)
    assert len(pauses) == 2 and paused[0].state is paused[1].state
    assert torch.allclose(paused[0].next_logits, whole.next_logits, rtol=0, atol=1e-12)
    growing = next(i for i, layer in enumerate(sampler.engine.adapter.layers) if layer.mixer.grows)
    assert len({id(b.arena) for b in paused[0].state.blocks(growing)}) == 1  # the chunks went into one arena

    def stop() -> None:
        raise RuntimeError("the client has gone")

    with pytest.raises(RuntimeError, match="the client has gone"):
        sampler.fork_pausing(prompt, 1, stop)
