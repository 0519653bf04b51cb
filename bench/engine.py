"""Engine benchmark: turn-append cost vs turn index against re-prefilling from scratch, and state bytes/token
measured vs analytic — printed as ratios measured side by side in one run.

An agent episode grows turn by turn: a long opening context, then per turn an assistant reply and a tool output.
The engine extends the previous turn's state by the new turn only; the baseline re-prefills the whole episode
(chunked capture from position 0, i.e. the engine's own fastest prefill) each turn.

    python bench/engine.py [--families llama qwen3_5 glm_moe_dsa] [--context 2048] [--turn 64] [--turns 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from longstraw_agents.engine import Engine
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import TINY_PRESETS, build_model


def bench_config(family: str):
    """Small but not toy models: 4 layers, hidden 256 (the hybrid keeps its 3:1 linear:full layout)."""
    overrides = {"hidden": 256, "layers": 4, "vocab_size": 2048}
    if family == "glm_moe_dsa":
        overrides["index_topk"] = 256  # sparse attention active beyond 256 keys
    return TINY_PRESETS[family](**overrides)


def timed(fn, repeats: int = 3) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def run_family(family: str, context: int, turn: int, turns: int, chunk: int) -> dict[str, float]:
    model = build_model(bench_config(family), dtype=torch.float32)
    engine = Engine(model, chunk_size=chunk)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    episode = torch.randint(0, vocab, (context + turns * turn,), generator=gen)
    state = engine.capture(episode[:context])
    reserve = turns * turn
    base_tokens = state.num_tokens
    append_ms, reprefill_ms = [], []
    for t in range(turns):
        lo, hi = context + t * turn, context + (t + 1) * turn
        # turn appends go into reserved storage (as the sampler does), so the state stays two blocks; one timing
        # per turn (a repeated extend of the same parent would fork instead of appending in place)
        seconds, state = timed(lambda s=state, lo=lo, hi=hi: engine.extend(s, episode[lo:hi], reserve=reserve), 1)
        append_ms.append(seconds * 1e3)
        if t in (0, turns // 2, turns - 1):
            seconds, _ = timed(lambda hi=hi: engine.capture(episode[:hi]), repeats=1)
            reprefill_ms.append(seconds * 1e3)
    # bytes/token from a plain capture of the final length (reserved storage would count unused capacity)
    final = engine.capture(episode[: state.num_tokens])
    small = engine.capture(episode[:base_tokens])
    measured = (final.nbytes - small.nbytes) / (final.num_tokens - small.num_tokens)
    analytic = state_size(model.config, torch.float32).bytes_per_token
    first, last = statistics.median(append_ms[:5]), statistics.median(append_ms[-5:])
    return {
        "append_first_ms": first,
        "append_last_ms": last,
        "flatness": last / first,
        "reprefill_last_ms": reprefill_ms[-1],
        "reprefill_growth": reprefill_ms[-1] / reprefill_ms[0],
        "speedup_at_last_turn": reprefill_ms[-1] / last,
        "bytes_per_token": measured,
        "bytes_ratio": measured / analytic,
        "state_mib": state.nbytes / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3_5", "glm_moe_dsa"])
    parser.add_argument("--context", type=int, default=2048, help="opening context tokens")
    parser.add_argument("--turn", type=int, default=64, help="tokens appended per turn")
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument("--chunk", type=int, default=512)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"context {args.context} tokens + {args.turns} turns x {args.turn} tokens, fp32, CPU, chunk {args.chunk}")
    header = (
        f"{'family':<12} {'append t1 ms':>12} {'append t32 ms':>13} {'t32/t1':>7} {'re-prefill t32 ms':>17} "
        f"{'re-prefill t32/t1':>17} {'speedup':>8} {'B/token':>8} {'meas/analytic':>13}"
    )
    print(header)
    print("-" * len(header))
    for family in args.families:
        r = run_family(family, args.context, args.turn, args.turns, args.chunk)
        print(
            f"{family:<12} {r['append_first_ms']:>12.1f} {r['append_last_ms']:>13.1f} {r['flatness']:>7.2f} "
            f"{r['reprefill_last_ms']:>17.1f} {r['reprefill_growth']:>17.2f} {r['speedup_at_last_turn']:>7.1f}x "
            f"{r['bytes_per_token']:>8.0f} "
            f"{r['bytes_ratio']:>13.3f}"
        )


if __name__ == "__main__":
    main()
