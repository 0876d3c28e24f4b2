"""The application builder Serve calls with the config's `args`
(`import_path: svip_serve.app:build_app`): settings checked, then one SVIPServer deployment whose
replicas each own a placement group of three bundles (the replica, the target, the draft),
strictly packed onto one node."""

from __future__ import annotations

from ray.serve import Application
from ray.serve.config import BackpressureConfig

from svip_serve.admission import RETRY_AFTER_S
from svip_serve.server import SVIPServer
from svip_serve.settings import REPLICA_CPUS, ServeSettings

ROUTE_HEADROOM = 8  # /health and /v1/models calls Serve may route past a full replica


def build_app(args: dict | None = None) -> Application:
    settings = ServeSettings.from_args(args)
    # Serve adds and removes pipelines with load when autoscaling is asked for; Ray's autoscaler
    # then follows with GPU workers (the chart enables it)
    scale = (
        {"autoscaling_config": settings.autoscaling}
        if settings.autoscaling
        else {"num_replicas": settings.num_replicas}
    )
    return SVIPServer.options(
        **scale,
        ray_actor_options={"num_cpus": REPLICA_CPUS},
        placement_group_bundles=settings.bundles(),
        placement_group_strategy="STRICT_PACK",
        # Serve routes up to this many requests to a replica; the replica's own admission
        # (max_in_flight + max_waiting) answers past its limits with an OpenAI-style 429
        max_ongoing_requests=settings.max_in_flight + settings.max_waiting + ROUTE_HEADROOM,
        max_queued_requests=settings.max_queued_requests,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S),
        health_check_period_s=settings.health_check_period_s,
        health_check_timeout_s=30,
        # a replica Serve stops (a scale-down, a rollout, a pod KubeRay stops) lets its requests
        # in flight finish for this long first
        graceful_shutdown_timeout_s=settings.drain_timeout_s,
    ).bind(settings)
