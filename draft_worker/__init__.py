"""The draft side: length policies, the drafter that proposes variable-length blocks, the draft
session's distributed protocol (pipelined.py, pure), its gRPC service and Ray actor. Runs in the
draft worker's process (and the drafter in the caller's, in-process mode).

May import: svip_common, svip_proto, svip_runtime."""
