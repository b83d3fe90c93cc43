"""The engine behind a network: the OpenAI-compatible server, replicas and routing, disaggregated prefill/decode,
cascades (lessons 12, 13)."""
