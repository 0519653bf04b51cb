"""``TorchSampler`` (torch_sampler.py): behaviour logprobs equal the model's distribution, one prompt capture shared
by a group, greedy / top-p / temperature draws, stop and length finishes."""

from __future__ import annotations

import pytest
import torch

from longstraw_agents.models.presets import tiny_model
from longstraw_agents.sampler import SamplingConfig
from longstraw_agents.torch_sampler import TorchSampler, sample_token

STOP = 7


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen3_5", dtype=torch.float64)


def full_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def test_generation_logprobs_match_the_models_distribution(model):
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=12, seed=3), chunk_size=4)
    prompt = list(range(20, 31))
    handles = sampler.fork(prompt, 3)
    for handle in handles:
        gen = sampler.generate(handle)
        sampler.append(handle, [40, 41, 42])  # an observation: extends the state, no re-prefill
        gen2 = sampler.generate(handle)
        history = prompt + gen.token_ids + [40, 41, 42] + gen2.token_ids
        assert handle.history == history and sampler.num_tokens(handle) == len(history)
        reference = full_logprobs(model, history)
        offset = len(prompt)
        for k, (token, lp) in enumerate(zip(gen.token_ids, gen.logprobs, strict=True)):
            assert lp == pytest.approx(float(reference[offset + k - 1, token]), abs=1e-5)
        offset = len(prompt) + len(gen.token_ids) + 3
        for k, (token, lp) in enumerate(zip(gen2.token_ids, gen2.logprobs, strict=True)):
            assert lp == pytest.approx(float(reference[offset + k - 1, token]), abs=1e-5)


def test_members_share_the_prompt_capture_and_diverge(model):
    sampler = TorchSampler(model, [STOP], SamplingConfig(max_new_tokens=8, seed=0))
    handles = sampler.fork(list(range(10, 40)), 4)
    first = handles[0].state
    assert all(h.state is first for h in handles)  # one capture, shared
    outputs = {tuple(sampler.generate(h).token_ids) for h in handles}
    assert len(outputs) > 1  # sampling at temperature 1 diverges


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
