"""A bf16 model's exact gradient at a long prompt against the same weights in fp64: the state gradient accumulated
in fp32 (the default) is closer than in bf16, and both are far closer than detached mode (bench/precision.py prints
the table)."""

from __future__ import annotations

import torch

from bench.precision import precision_table
from longstraw_agents.state import Arena, StateGrad


def test_fp32_accumulation_beats_bf16_and_both_beat_detached() -> None:
    # 64 chunks to sum over (measured: fp32 6.27e-3 < bf16 6.34e-3 < detached / 10 1.57e-2; at 2048 tokens, 128
    # chunks, 8.80e-3 < 8.86e-3 < 1.84e-2 for 3.6x the time)
    table = precision_table("llama", prompt_len=1024, chunk=16, group=2, completion=8)
    detached = table["detached"]["relative_l2"]
    bf16 = table["exact, bf16 state-gradient buffers"]["relative_l2"]
    fp32 = table["exact, fp32 state-gradient buffers"]["relative_l2"]
    assert fp32 < bf16 < detached / 10
    assert table["exact, fp32 state-gradient buffers"]["cosine"] > 0.9999


def test_state_gradient_buffers_are_fp32_for_bf16_states_and_counted_so() -> None:
    arena = Arena(((2, 4),), 8, torch.bfloat16, torch.device("cpu"))
    block = arena.append((torch.ones(3, 2, 4, dtype=torch.bfloat16),))
    wide, own = StateGrad(), StateGrad(accumulate_dtype=None)
    assert wide.block_grads(block)[0].dtype == torch.float32 and own.block_grads(block)[0].dtype == torch.bfloat16
    assert wide.nbytes == 2 * arena.nbytes and own.nbytes == arena.nbytes
    fp64 = Arena(((2,),), 4, torch.float64, torch.device("cpu"))
    assert StateGrad().arena_buffers(fp64)[0].dtype == torch.float64  # never narrower than the state
