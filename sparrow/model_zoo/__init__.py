"""Models that need no network: tiny random checkpoints for tests, and the real SmolLM2-135M-Instruct."""

from .smollm2 import default_model_dir, fetch_smollm2
from .tiny import build_tiny_checkpoint, build_tokenizer

__all__ = ["build_tiny_checkpoint", "build_tokenizer", "default_model_dir", "fetch_smollm2"]
