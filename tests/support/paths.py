"""Where the repository is, for tests that read its files (README, examples, scripts) from any depth of tests/."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
