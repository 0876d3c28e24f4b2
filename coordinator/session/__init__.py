"""The distributed sessions, run in the target worker's process beside its verifier: the session
host (the TargetWorker gRPC service and its batched verification step; pages.py: KV pages by use;
idle_work.py: what the target does while no block is ready), each session's protocol (pipeline.py:
the round; attachment.py, waiting.py, speculation.py: its parts over the same state: the draft's
mode and recovery, the target's work while it waits, caps and auto's rule), its parts that decide
nothing (ahead.py:
blocks drafted ahead of a verdict; reattach.py: recovery's re-attach schedule; pausing.py:
load-aware pauses; feedback.py: the feedback owed to the draft; round_log.py: the statistics)
and what it checks of the draft's messages (wire_checks.py), the link to the draft worker and its
recovery (draft_link.py, draft_port.py), the caller's events made into messages on the stream's
side (caller_events.py), and the target's Ray actor (actor.py).
The protocol logic (pipeline.py and its parts) is a core with no I/O: each event takes the time
now and returns its effects (effects.py), which the host carries out; it speaks
svip_common.messages, and protobuf is read and written at the edges only (host.py, draft_port.py,
caller_events.py).

May import: svip_common and target_worker; at the edges (host.py, draft_port.py, draft_link.py,
caller_events.py, actor.py) also svip_proto and svip_runtime. Nothing else of the coordinator: not the caller's end
(distributed, client, cluster, local), nor the in-process engine or its calibration."""
