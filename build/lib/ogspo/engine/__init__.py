"""Lossless tree speculative decoding: trees, target forwards, drafters, policies, verification."""
