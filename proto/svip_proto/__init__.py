"""The gRPC contract (svip.proto), its generated Python, and the one proto <-> Python converter.
Regenerate with proto/regenerate.sh. Runs in every process that speaks the wire.

May import: svip_common (the types it converts), protobuf, grpc."""
