"""Code both workers and the coordinator import: contracts, sampling, randomness, the cache
adapter and model loading. Nothing here knows about Ray or gRPC."""
