"""The draft side: length policies, the drafter that proposes variable-length blocks, the draft
session's distributed protocol (pure: its state in line_state.py, the worker's steps over it in
stepping.py, the target's messages in pipelined.py, a follow-up's growth in growth.py), its gRPC
service and Ray actor. Runs in the draft worker's process (and the drafter in the caller's,
in-process mode).

May import: svip_common, svip_proto, svip_runtime."""
