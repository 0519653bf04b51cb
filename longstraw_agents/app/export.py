"""A run's checkpoint as a Hugging Face model directory (``save_pretrained``; ``from_pretrained`` reads it back).

The policy is rebuilt from the run's ``config.json`` (its preset or ``model.path``, as ``Run`` builds it) and given
the checkpoint's weights: ``model.safetensors`` of a replicated run, or the shards of an FSDP2 run
(``parallel.checkpoint``), assembled in this one process. The run's tokenizer is written beside them, so that
``AutoTokenizer.from_pretrained(out)`` loads it: the shipped BPE as a ``tokenizer.json`` that encodes and decodes
token for token as the run did, or the run's own Hugging Face tokenizer. Only the weights are exported: the
optimizer state and the counters stay in the checkpoint.

A LoRA run (``model.lora``) is exported as its adapter in PEFT's format (``adapter_config.json`` and
``adapter_model.safetensors``: ``PeftModel.from_pretrained(base, out)`` loads it onto the base, which the config names
when the run's model was a ``model.path``) with the tokenizer beside it; ``merged=True`` (``--merged``) writes the
model with the adapter merged into its weights instead, a plain Hugging Face model directory.

What a transformers user needs to chat with the policy comes with it, as a Qwen instruct checkpoint has it:

- the chat format the run trained on as the tokenizer's chat template (``app.chat_template``), so that
  ``apply_chat_template(messages, tools=...)`` renders the ids the environments rendered;
- the end of a turn as the end of generation: ``config.json``'s ``eos_token_id`` is ``<|im_end|>``,
  ``generation_config.json``'s the stop ids of the chat format (``<|im_end|>``, then ``<|endoftext|>``), and both
  pad with the tokenizer's pad token, so that ``generate`` stops where the policy ends its turn. The run's prompts
  start without a BOS token, so neither names one.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import load_model
from transformers import GenerationConfig
from transformers.utils import logging as transformers_logging

from longstraw_agents.app.chat_template import JINJA_CHAT_TEMPLATE
from longstraw_agents.app.config import ConfigError, TrainConfig, check_model, check_tokenizer, validation_lines
from longstraw_agents.app.run import CHECKPOINT, build_policy
from longstraw_agents.chat import ChatFormatter
from longstraw_agents.models.lora import lora_layers, merged_copy, save_adapter
from longstraw_agents.parallel.checkpoint import SHARDED, load_full_model
from longstraw_agents.tokenizer import HFTokenizer, TiktokenTokenizer, Tokenizer
from longstraw_agents.trainer import GRPOTrainer


@dataclass
class RunPolicy:
    """The policy of a run's checkpoint, with the run's config and tokenizer and the checkpoint's policy version."""

    config: TrainConfig
    tokenizer: Tokenizer
    model: torch.nn.Module
    policy_version: int


def load_run_policy(run_dir: str | Path) -> RunPolicy:
    """The policy of ``run_dir``'s checkpoint, rebuilt from the run's ``config.json`` (``ConfigError`` when the
    config no longer loads, ``FileNotFoundError`` without a config or a checkpoint)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise FileNotFoundError(f"{run_dir} is not a run directory: it has no config.json")
    try:
        config = TrainConfig.model_validate_json((run_dir / "config.json").read_text())
    except ValidationError as err:
        lines = validation_lines(err, schema=TrainConfig)
        raise ConfigError(f"{run_dir}/config.json is not a run config:\n{lines}") from None
    tokenizer = check_tokenizer(config.tokenizer)
    model = build_policy(config.model, check_model(config.model, tokenizer.vocab_size), config.seed)
    checkpoint = GRPOTrainer.resolve_checkpoint(run_dir / CHECKPOINT)
    if (checkpoint / SHARDED).is_dir():
        load_full_model(model, checkpoint)
    else:
        load_model(model, str(checkpoint / "model.safetensors"))
    version = int(GRPOTrainer.checkpoint_info(checkpoint)["policy_version"])
    return RunPolicy(config, tokenizer, model, version)


def export_hf(run_dir: str | Path, out_dir: str | Path, *, force: bool = False, merged: bool = False) -> Path:
    """Write the policy of ``run_dir``'s checkpoint and the run's tokenizer to ``out_dir`` as a Hugging Face model
    directory (see the module docstring), or a LoRA run's adapter in PEFT's format (``merged``: the model with the
    adapter merged in). A non-empty ``out_dir`` is refused (``FileExistsError``) unless ``force``: the export's files
    then replace those of the same name (``save_pretrained`` also removes weight shards of an earlier save)."""
    out_dir = Path(out_dir)
    _check_out_dir(out_dir, force)
    with quiet_transformers():
        policy = load_run_policy(run_dir)
        lora = bool(lora_layers(policy.model))
        if merged and not lora:
            raise ConfigError(f"--merged: the run in {run_dir} trains no LoRA adapter (its export is the whole model)")
        transformers_model: Any = merged_copy(policy.model) if merged else policy.model  # a transformers model
        stop_at_end_of_turn(transformers_model, policy.tokenizer)
        if lora and not merged:
            save_adapter(transformers_model, out_dir, policy.config.model.path)
            transformers_model.generation_config.save_pretrained(out_dir)
        else:
            transformers_model.save_pretrained(out_dir)
        save_tokenizer(policy.tokenizer, out_dir)
    return out_dir


def stop_at_end_of_turn(model: Any, tokenizer: Tokenizer) -> None:
    """Set ``model``'s end-of-sequence and padding ids to those of the chat format (``ChatFormatter``'s stop ids) and
    of ``tokenizer``, in its config and its generation config, as Qwen's instruct checkpoints set them."""
    stop_ids = list(ChatFormatter(tokenizer).stop_token_ids)  # <|im_end|> first
    model.config.eos_token_id = stop_ids[0]
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = None
    # the model's other generation settings kept; a config of its own, no longer one derived from config.json
    kept = {
        key: value
        for key, value in model.generation_config.to_diff_dict().items()
        if not key.startswith("_") and key != "transformers_version"  # metadata, not settings
    }
    stops = {"eos_token_id": stop_ids if len(stop_ids) > 1 else stop_ids[0], "pad_token_id": tokenizer.pad_token_id}
    model.generation_config = GenerationConfig(**{**kept, **stops, "bos_token_id": None})


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """The run's tokenizer as Hugging Face files (``AutoTokenizer.from_pretrained(out_dir)`` loads them), with the
    run's chat format as its chat template: the shipped BPE converted to a ``tokenizer.json`` that encodes and decodes
    as it does, or the run's HF tokenizer (whose own template, if any, is replaced: the run did not train on it)."""
    if not isinstance(tokenizer, TiktokenTokenizer | HFTokenizer):
        raise TypeError(f"cannot write {tokenizer!r} as a Hugging Face tokenizer")
    tokenizer.save_pretrained(out_dir, chat_template=JINJA_CHAT_TEMPLATE)


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Run the block with transformers' progress bars ("Writing model shards") off, its log messages below errors
    dropped and its Python warnings ignored, so that a command that loads and saves a checkpoint prints its own lines
    only. The settings are restored on exit."""
    bars, verbosity = transformers_logging.is_progress_bar_enabled(), transformers_logging.get_verbosity()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"(transformers|huggingface_hub)(\.|$)")
            yield
    finally:
        transformers_logging.set_verbosity(verbosity)
        if bars:
            transformers_logging.enable_progress_bar()


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file; the export writes a directory")
    held = sorted(entry.name for entry in out_dir.iterdir()) if out_dir.is_dir() else []
    if held and not force:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise FileExistsError(
            f"{out_dir} is not empty ({shown}); choose another directory, or pass --force to write the export into "
            "it (files of the same name are replaced)"
        )
