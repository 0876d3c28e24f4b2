"""`svip serve`: the Serve app on this machine, Ray bound to loopback (DESIGN.md, Placement), the
HTTP proxy on --host/--port (127.0.0.1:8000 by default), until interrupted."""

from __future__ import annotations

import signal
import sys
import threading

from svip_serve.settings import ServeSettings

APP_NAME = "svip"


def start(settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000, metrics_port: int | None = None) -> str:
    """Start Ray, Serve and the app; returns the API's base URL once the app is running."""
    from coordinator.cluster import init_local_ray

    init_local_ray(pairs=settings.num_replicas, metrics_port=metrics_port)  # first: it sets Ray's loopback switch before ray is imported
    from ray import serve

    from svip_serve.app import build_app

    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(_args(settings)), name=APP_NAME, route_prefix="/")
    return f"http://{host}:{port}/v1"


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def serve_forever(settings: ServeSettings, host: str, port: int, metrics_port: int) -> int:
    url = start(settings, host, port, metrics_port)
    print(f"svip: serving {settings.served_name!r} at {url}, Prometheus metrics at "
          f"http://127.0.0.1:{metrics_port}/metrics (Ctrl-C stops)", file=sys.stderr, flush=True)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        stopping.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop()
    return 0


def _args(settings: ServeSettings) -> dict:
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(settings).items() if v != getattr(ServeSettings, k, None)}
