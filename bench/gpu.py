"""Long-context figures on one accelerator: capture and GRPO steps of a scaled-up hybrid model (bf16).

A Qwen3.6-like hybrid layout (3 GatedDeltaNet : 1 gated attention) at hidden 2048 and 16 layers: capture of a
prompt of P positions (tokens/s, peak memory, state bytes measured vs ``state_size``), then a detached GRPO step of
G short completions over it and, at the first length only, an exact step (the gradient through the whole prefix).
``bench/gpu.sh`` runs it on a GPU machine; ``--device cpu --quick`` runs the same code at toy sizes (the suite's
smoke test).

    python -m bench.gpu [--lengths 131072 524288] [--exact-at 131072] [--device cuda] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import Qwen3_5TextConfig

from longstraw_agents.engine import Engine, EngineConfig
from longstraw_agents.models import state_size
from longstraw_agents.models.presets import build_model, hybrid_layer_types
from longstraw_agents.trainer import grpo_backward

RESULTS = Path(__file__).parent / "results"


def scaled_hybrid(hidden: int, layers: int) -> Qwen3_5TextConfig:
    """The Qwen3.6-27B layout at a size one GPU holds with room for millions of positions of state."""
    heads = max(2, hidden // 128)
    return Qwen3_5TextConfig(
        vocab_size=32768,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 8),
        head_dim=min(128, hidden // heads * 2),
        linear_num_key_heads=max(1, heads // 2),
        linear_num_value_heads=heads,
        linear_key_head_dim=min(128, hidden // heads),
        linear_value_head_dim=min(128, hidden // heads),
        linear_conv_kernel_dim=4,
        layer_types=hybrid_layer_types(layers),
        max_position_embeddings=1 << 22,
        tie_word_embeddings=False,
    )


class Clock:
    """Wall time and peak accelerator memory of a block (synchronising the device around it)."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self) -> Clock:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start
        self.peak = torch.cuda.max_memory_allocated() if self.device.type == "cuda" else None


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def run_length(model, engine: Engine, length: int, group: int, completion: int, exact: bool) -> dict:
    device = engine.adapter.device
    gen = torch.Generator().manual_seed(length)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (length,), generator=gen).to(device)
    completions = [torch.randint(0, vocab, (completion,), generator=gen).to(device) for _ in range(group)]
    rewards = torch.rand(group, generator=gen).tolist()
    with Clock(device) as clock, torch.no_grad():
        state = engine.capture(prompt)
    analytic = state_size(model.config, model.dtype).total(length)
    row = {
        "positions": length,
        "capture_s": clock.seconds,
        "capture_tokens_per_s": length / clock.seconds,
        "capture_peak_bytes": clock.peak,
        "state_bytes": state.nbytes,
        "state_bytes_analytic": analytic,
    }
    del state
    modes = ("detached", "exact") if exact else ("detached",)
    for mode in modes:
        model.zero_grad(set_to_none=True)
        with Clock(device) as clock:
            grpo_backward(engine, prompt, completions, rewards, mode, track_memory=False)
        row[f"{mode}_s"] = clock.seconds
        row[f"{mode}_tokens_per_s"] = (length + group * completion) / clock.seconds
        row[f"{mode}_peak_bytes"] = clock.peak
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[131072, 524288])
    parser.add_argument("--exact-at", nargs="*", type=int, default=[131072], help="lengths that also run exact")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=4096)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quick", action="store_true", help="toy sizes: the smoke test of this script")
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu.json")
    args = parser.parse_args()
    if args.quick:
        args.lengths, args.exact_at, args.hidden, args.layers = [256, 512], [256], 128, 4
        args.group, args.completion, args.chunk = 2, 8, 128
    device = torch.device(args.device)
    model = build_model(scaled_hybrid(args.hidden, args.layers), dtype=getattr(torch, args.dtype)).to(device)
    engine = Engine(model, EngineConfig(chunk_size=args.chunk))
    params = sum(p.numel() for p in model.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}; hybrid {args.layers} layers, hidden {args.hidden}, {params / 1e6:.0f}M parameters, {args.dtype}")
    print(f"G={args.group} completions of {args.completion}; chunk {args.chunk}; attention backend 'auto'")
    header = (
        f"{'positions':>10} {'capture tok/s':>13} {'capture peak GiB':>16} {'state GiB':>9} {'meas/an.':>8} "
        f"{'detached s':>10} {'det. peak GiB':>13} {'exact s':>8} {'exact peak GiB':>14}"
    )
    print(header)
    results = []
    for length in args.lengths:
        row = run_length(model, engine, length, args.group, args.completion, length in args.exact_at)
        results.append(row)
        exact = f"{row['exact_s']:>8.1f} {gib(row['exact_peak_bytes']):>14}" if "exact_s" in row else ""
        print(
            f"{length:>10} {row['capture_tokens_per_s']:>13.0f} {gib(row['capture_peak_bytes']):>16} "
            f"{row['state_bytes'] / 2**30:>9.2f} {row['state_bytes'] / row['state_bytes_analytic']:>8.3f} "
            f"{row['detached_s']:>10.1f} {gib(row['detached_peak_bytes']):>13} {exact}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: str(v) for k, v in vars(args).items() if k != "out"}
    args.out.write_text(json.dumps({"device": name, "args": settings, "results": results}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
