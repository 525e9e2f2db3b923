"""Decoding: drafters, draft trees, verification and the decoding loop (torch + transformers only)."""
