"""Per-family model adapters for the engine: one file per family."""
