#!/usr/bin/env bash
# Regenerate the checked-in Python for proto/svip_proto/svip.proto.
# tests/unit/test_proto_drift.py fails when the checked-in files differ from this output.
set -euo pipefail
cd "$(dirname "$0")"
python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. svip_proto/svip.proto
