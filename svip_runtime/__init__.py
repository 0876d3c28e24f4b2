"""What every worker process runs on: the gRPC session server and its compute thread, the Ray actor
lifecycle (load, serve, health, a replaced actor's address), mutual TLS, step metrics, and the
client helpers to reach a worker. Runs in the draft and target worker processes (and the caller's,
for the client helpers).

May import: svip_common, svip_proto, grpc, ray. Not the model sides or anything above them."""
