"""`svip serve`: the Serve app on this machine, Ray bound to loopback (docs/architecture.md, Placement), the
HTTP proxy on --host/--port (127.0.0.1:8000 by default), until interrupted."""

from __future__ import annotations

import signal
import socket
import sys
import threading

from svip_common.errors import SvipError
from svip_serve.settings import ServeSettings

APP_NAME = "svip"
_BOARD = None  # the drain board this process made (svip_serve/draining.py)


def start(settings: ServeSettings, host: str = "127.0.0.1", port: int = 8000, metrics_port: int | None = None,
          on_stop_signal=None) -> str:
    """Start Ray, Serve and the app; returns the API's base URL once the app is running.
    on_stop_signal: called on SIGTERM or SIGINT from the moment Ray runs (ray.init installs a
    handler of its own that dumps a stack and aborts; the app answers /health before serve.run
    returns, so a signal can come while it still waits)."""
    check_free(host, port, "--port")
    if metrics_port is not None:
        check_free("127.0.0.1", metrics_port, "--metrics-port")
    check_models(settings)
    from coordinator.cluster import init_local_ray

    init_local_ray(  # first: it sets Ray's loopback switch before ray is imported
        pairs=settings.num_replicas, metrics_port=metrics_port, target_ranks=settings.target_tp,
        draft_ranks=settings.draft_tp
    )
    if on_stop_signal is not None:
        for stop_signal in (signal.SIGTERM, signal.SIGINT):  # what systemd, Docker, Kubernetes and Ctrl-C send
            signal.signal(stop_signal, lambda *_: on_stop_signal())
    from ray import serve

    from svip_serve.app import build_app
    from svip_serve.draining import make_board

    global _BOARD
    _BOARD = make_board()  # before the app: its replicas look for it (svip_serve/draining.py)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(_args(settings)), name=APP_NAME, route_prefix="/")
    except Exception as exc:  # a Ray task error: its last line names the cause
        stop()
        if isinstance(exc, SvipError):
            raise
        raise SvipError(f"the app did not start: {str(exc).strip().splitlines()[-1]}") from None
    return f"http://{host}:{port}/v1"


def check_models(settings: ServeSettings) -> None:
    """The models' configs and tokenizers load and fit together: a clear error before Ray starts."""
    from svip_common.models import check_same_vocabulary, is_feature_head, load_model_info

    target, draft = settings.model_paths()
    info = load_model_info(target)
    if draft is not None and not is_feature_head(draft):  # a head is checked against the target as it loads
        check_same_vocabulary(info, load_model_info(draft))


def check_free(host: str, port: int, flag: str) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise SvipError(f"{flag} {port}: cannot listen on {host}:{port} ({exc.strerror})") from None


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


def serve_forever(settings: ServeSettings, host: str, port: int, metrics_port: int) -> int:
    stopping = threading.Event()
    url = start(settings, host, port, metrics_port, on_stop_signal=stopping.set)
    keys = f"{len(settings.api_key_sha256)} API key(s) required" if settings.api_key_sha256 else "no API key required"
    print(
        f"svip: serving {settings.served_name!r} at {url} ({keys}), Prometheus metrics at "
        f"http://127.0.0.1:{metrics_port}/metrics (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    try:
        while not stopping.wait(3600):  # wait() with no timeout never returns to run the signal's handler
            pass
        print(f"svip: stopping: no new requests; waiting up to {settings.drain_timeout_s:g} s for those in flight",
              file=sys.stderr, flush=True)
        from svip_serve.draining import drain

        drained = drain(_BOARD, settings.num_replicas, settings.drain_timeout_s)
        print("svip: " + ("every request finished" if drained else "the grace period ended") + "; stopped",
              file=sys.stderr, flush=True)
    finally:
        stop()
    return 0


def _args(settings: ServeSettings) -> dict:
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(settings).items() if v != getattr(ServeSettings, k, None)}
