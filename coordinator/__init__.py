"""The coordinator: how a request becomes rounds. Three processes run code from here:

- in-process mode (the caller's process runs both models): engine.py, batch.py, calibration.py;
- the front the CLI runs either mode through: front.py;
- the caller's end of the distributed pipeline (the CLI, a Serve replica): distributed.py,
  client.py, cluster.py (placement and the worker pair), local.py; and in_memory.py, both
  workers' services run by hand in the caller's thread (the protocol without sockets, for tests);
- the target worker's process: session/ (its own rule there).

May import: svip_common, svip_proto, svip_runtime, draft_worker, target_worker. session/ imports
nothing from the caller's end; the in-process modules import nothing from session/."""
