"""Wait until the compose kube-apiserver answers ``ok`` on /readyz (the `apiserver-ready` service).

The kube-apiserver image is distroless (no shell, no curl), so it cannot carry a compose
healthcheck; this one-shot service polls /readyz instead and exits 0 once it answers ``ok``,
or 1 after TIMEOUT_S seconds. /readyz is readable anonymously (the default
system:public-info-viewer role); the serving certificate is verified against the compose CA.

Env: APISERVER_URL (https://kube-apiserver:6443), CA_FILE (/pki/ca.crt), TIMEOUT_S (120).
"""

from __future__ import annotations

import os
import ssl
import sys
import time
import urllib.request


def main() -> int:
    url = os.environ.get("APISERVER_URL", "https://kube-apiserver:6443").rstrip("/") + "/readyz"
    ca_file = os.environ.get("CA_FILE", "/pki/ca.crt")
    timeout_s = float(os.environ.get("TIMEOUT_S", "120"))
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    while time.monotonic() < deadline:
        try:
            context = ssl.create_default_context(cafile=ca_file)
            with urllib.request.urlopen(url, timeout=5, context=context) as response:
                body = response.read().decode("utf-8", "replace").strip()
            if body == "ok":
                print(f"wait-for-apiserver: {url} is ready", flush=True)
                return 0
            last_error = f"answered {body[:80]!r}"
        except (OSError, ssl.SSLError) as exc:  # URLError and HTTPError are OSErrors
            last_error = str(exc)
        time.sleep(1)
    print(
        f"wait-for-apiserver: {url} not ready after {timeout_s:g}s: {last_error}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
