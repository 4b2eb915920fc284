"""A JSON POST to a server the tests started: the status and the decoded answer, errors included."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def post_json(base: str, path: str, body: dict[str, Any], timeout: float = 300) -> tuple[int, Any]:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
