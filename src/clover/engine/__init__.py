"""Serving engine: continuous batching over `clover.generation.Decoder`, a bounded queue, metrics."""

from .engine import Engine, EngineClosed, EngineOptions, QueueFull, RequestTooLarge
from .handle import EngineEvent, RequestHandle
from .metrics import EngineMetrics

__all__ = ["Engine", "EngineOptions", "EngineEvent", "RequestHandle", "QueueFull", "EngineClosed",
           "RequestTooLarge", "EngineMetrics"]
