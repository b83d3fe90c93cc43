"""The engine behind a network (lesson 12): the OpenAI-compatible server, its access rules and the engine thread.
Many engines (replicas, disaggregated prefill/decode, cascades) are lesson 13's: minillm/cluster."""
