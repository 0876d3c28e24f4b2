"""The gRPC contract (svip.proto), its generated Python, and the one proto <-> Python converter.
Regenerate with proto/regenerate.sh."""
