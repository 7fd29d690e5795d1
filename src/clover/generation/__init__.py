"""Block-diffusion generation: settings (§5–§10), per-request state, the batched decoding loop."""

from .api import GenerationResult, generate, generate_batch
from .settings import GenerationSettings, GenerationSettingsError

__all__ = ["generate", "generate_batch", "GenerationResult", "GenerationSettings", "GenerationSettingsError"]
