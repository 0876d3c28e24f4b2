"""The Ray Serve application: an OpenAI-compatible HTTP front over one SVIP pipeline per replica
(a draft actor and a target actor in the replica's placement group). `svip serve` runs it on this
machine; `serve run deploy/serve-config.yaml` and the Helm chart in deploy/helm run it on clusters.
Runs in the Serve replicas and the proxy.

May import: svip_common, svip_proto, svip_runtime, coordinator (its caller's end), svip_assets."""
