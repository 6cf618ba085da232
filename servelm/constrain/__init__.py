"""Constrained decoding with llguidance: request constraints → compiled grammars → per-step token masks."""
