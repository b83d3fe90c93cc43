"""Fewer, bigger operations per decode step: hand-fused layers and torch.compile (lesson 06)."""
