"""Runnable examples of weightsync (``python -m examples.<name>`` from the repository root)."""
