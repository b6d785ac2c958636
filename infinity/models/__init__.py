"""Small reference models used by the tests, benchmarks and demo, and the
demo's corpus (corpus.py: text every Python installation carries).

Owns: model definitions only, no runtime state. May import: nothing of
infinity.
"""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
