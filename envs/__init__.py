"""Gymnasium environments for agents (registered under the ``LongStraw`` namespace)."""
