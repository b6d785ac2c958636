"""Small reference models used by the tests, benchmarks and demo."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
