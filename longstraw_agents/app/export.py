"""A run's checkpoint as a Hugging Face model directory (``save_pretrained``; ``from_pretrained`` reads it back).

The policy is rebuilt from the run's ``config.json`` (its preset or ``model.path``, as ``Run`` builds it) and given
the checkpoint's weights: ``model.safetensors`` of a replicated run, or the shards of an FSDP2 run
(``parallel.checkpoint``), assembled in this one process. Only the weights are exported: the optimizer state and the
counters stay in the checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_model

from longstraw_agents.app.config import TrainConfig, check_model, check_tokenizer
from longstraw_agents.app.run import CHECKPOINT, build_policy
from longstraw_agents.parallel.checkpoint import SHARDED, load_full_model
from longstraw_agents.trainer import GRPOTrainer


def export_hf(run_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the policy of ``run_dir``'s checkpoint to ``out_dir`` as a Hugging Face model directory."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no config.json")
    config = TrainConfig.model_validate_json((run_dir / "config.json").read_text())
    tokenizer = check_tokenizer(config.tokenizer)
    model = build_policy(config.model, check_model(config.model, tokenizer.vocab_size), config.seed)
    checkpoint = GRPOTrainer.resolve_checkpoint(run_dir / CHECKPOINT)
    if (checkpoint / SHARDED).is_dir():
        load_full_model(model, checkpoint)
    else:
        load_model(model, str(checkpoint / "model.safetensors"))
    transformers_model: Any = model  # a transformers PreTrainedModel (build_policy types it as a Module)
    transformers_model.save_pretrained(out_dir)
    return out_dir
