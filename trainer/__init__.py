"""GRPO trainer over segment trees (filled by the trainer issue)."""
