"""Container HEALTHCHECK for the Multiplex images: exit 0 when the service's /health answers 200, else 1.

Standard library only, so it works in every image and stage. MPLEX_HEALTH_URL picks the port (gateway 8000,
engine 8100, worker and beat 9100).
"""
from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8000/health"


def is_healthy(url: str, timeout: float = 3.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - a fixed local URL
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main() -> int:
    return 0 if is_healthy(os.environ.get("MPLEX_HEALTH_URL", DEFAULT_URL)) else 1


if __name__ == "__main__":
    sys.exit(main())
