"""Past one engine (lesson 13): replicas behind a router, disaggregated prefill/decode, a cascade of two models.
Each worker is a process (workers.py owns their lifecycle); the coordinator here never touches a tensor."""
