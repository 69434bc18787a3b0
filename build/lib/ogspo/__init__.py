"""ogspo: tree-based speculative decoding with stop decisions taken during drafting."""

__version__ = "0.1.0"
