"""Typed tools, the tool registry and the code sandbox."""
