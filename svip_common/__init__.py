"""The pure core: the contracts (request, block, verdict, stats), sampling and rejection rules,
randomness, the paged KV pool (its attention hook, its flat decoder for Llama-family models),
grouped-head attention, model loading, the load-aware cost model and the `auto` acceptance model.
Runs in every process that touches a model.

May import: torch, transformers, the standard library, and itself. Never gRPC, Ray, svip_proto or
any package above it (tests/unit/test_layout.py holds the rule)."""
