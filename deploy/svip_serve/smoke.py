"""A smoke check of a running server, with the standard library only: `helm test` runs it in the
cluster (SVIP_URL, SVIP_MODEL, and SVIP_API_KEY when the API needs a key). /health, /v1/models
lists the model, a one-token completion. deploy/helm/svip/files/smoke.py is a copy of this file
(the chart's test pod runs it from a small Python image); a test keeps the two identical."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request

TIMEOUT_S = 60.0


def _call(url: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    key = os.environ.get("SVIP_API_KEY", "").split(",")[0].strip()
    named = re.match(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}:(.+)$", key)  # `name:KEY` names the key (auth.py)
    key = named.group(1) if named else key
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())


def check(base: str, model: str, wait_s: float = 300.0) -> str:
    """'' when the server passes, else what failed."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            _call(f"{base}/health")
            break
        except (urllib.error.URLError, OSError) as exc:
            if time.monotonic() > deadline:
                return f"{base}/health did not answer 200 within {wait_s:.0f} s: {exc}"
            time.sleep(2)
    ids = [m["id"] for m in _call(f"{base}/v1/models")["data"]]
    if model not in ids:
        return f"/v1/models lists {ids}, not {model!r}"
    out = _call(f"{base}/v1/completions", {"model": model, "prompt": "def", "max_tokens": 1, "temperature": 0})
    if out["usage"]["completion_tokens"] != 1 or len(out["choices"]) != 1:
        return f"unexpected completion: {out}"
    return ""


def main() -> int:
    base, model = os.environ["SVIP_URL"].rstrip("/"), os.environ["SVIP_MODEL"]
    try:
        problem = check(base, model)
    except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
        problem = f"{type(exc).__name__}: {exc}"
    print(f"svip smoke: {problem or 'ok'} ({base}, model {model!r})")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())
