"""`svip bench`: every length policy, the oracle and Hugging Face's assisted generation, side by
side on the same prompts, interleaved; the pipeline, serve, long-generation and fault drills.
Runs in the benchmark's process (it starts Ray and `svip serve` as it needs).

May import: svip_common, svip_proto, svip_runtime, draft_worker, target_worker, coordinator,
svip_serve, svip_assets. Only svip_cli imports it."""
