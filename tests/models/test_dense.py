"""Sliding-window dense models (Mistral's default config, Qwen2 with use_sliding_window): accepted, equal to
transformers while the context fits in the window, and a clear error — not silently full attention — past it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from longstraw_agents.engine import Engine
from longstraw_agents.models.dense import SlidingWindowExceededError, sliding_windows

WINDOW, VOCAB = 8, 64


TINY = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2}  # fmt: skip


def mistral(sliding_window: int | None = WINDOW, seed: int = 0) -> torch.nn.Module:
    config = MistralConfig(**TINY, num_hidden_layers=2, max_position_embeddings=1024, sliding_window=sliding_window)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids.unsqueeze(0)).logits[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


IDS = torch.randint(0, VOCAB, (WINDOW + 1,), generator=torch.Generator().manual_seed(0))


def test_mistral_default_config_is_accepted():
    config = MistralConfig(**TINY, num_hidden_layers=1)  # sliding_window left at Mistral's default
    assert config.sliding_window == 4096
    engine = Engine(AutoModelForCausalLM.from_config(config))
    assert engine.adapter.window == 4096 and engine.capture(IDS).num_tokens == len(IDS)


def test_within_the_window_the_engine_matches_transformers_sliding_window_forward():
    model = mistral()
    engine = Engine(model, chunk_size=3)
    state = engine.capture(IDS[:5])
    with torch.no_grad():
        out = engine.logits(state, IDS[5:WINDOW])
    assert rel_err(out, logits(model, IDS[:WINDOW])[5:]) < 1e-5


def test_the_window_boundary_is_where_transformers_starts_dropping_keys():
    """Sliding-window and full attention (same weights) agree up to WINDOW tokens and differ at WINDOW + 1, so
    the engine's limit is exactly the window."""
    windowed, full = mistral(), mistral(sliding_window=None)
    assert torch.equal(logits(windowed, IDS[:WINDOW]), logits(full, IDS[:WINDOW]))
    assert rel_err(logits(windowed, IDS)[-1], logits(full, IDS)[-1]) > 1e-4


@pytest.mark.parametrize("how", ["capture", "extend", "step", "logits"])
def test_reaching_past_the_window_raises(how):
    engine = Engine(mistral(), chunk_size=4)
    state = engine.capture(IDS[:WINDOW])
    with pytest.raises(SlidingWindowExceededError, match=f"sliding_window={WINDOW}.*reaches {WINDOW + 1} tokens"):
        if how == "capture":
            engine.capture(IDS)
        elif how == "extend":
            engine.extend(state, IDS[-1:])
        elif how == "step":
            engine.step(state, IDS[-1:])
        else:
            engine.logits(state, IDS[-1:])


def test_per_layer_windows_follow_transformers_layer_types():
    qwen2 = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert sliding_windows(qwen2) == [None, WINDOW, WINDOW]
    assert sliding_windows(Qwen2Config(num_hidden_layers=2)) == [None, None]
    assert sliding_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
