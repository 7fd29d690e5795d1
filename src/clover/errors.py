"""Errors a user sees from a model file, in a module of their own so that any layer may raise them
without importing the loaders."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as asked; the message names the key, file and shapes."""
