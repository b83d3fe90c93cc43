"""Speculative decoding: drafters propose k tokens, one target forward verifies them (lesson 10)."""
