"""`make demo`: a local cloud-server on a free port, the edge client answering one prompt with
live output and stats, then the server stopped."""
from __future__ import annotations

import signal
import subprocess
import sys

PROMPT = "Explain in a few sentences why the sky is blue, then list three related facts."


def main() -> int:
    print("starting cloud-server (the first start converts the embedded model and builds the "
          "MoA drafter bundle, about a minute)...",
          file=sys.stderr, flush=True)
    server = subprocess.Popen([sys.executable, "-m", "cloud_server.cli", "--port", "0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = server.stdout.readline().strip()
        if not line.startswith("listening on "):
            print(f"demo: cloud-server did not start ({line!r})", file=sys.stderr)
            return 1
        address = line.removeprefix("listening on ")
        print(f"cloud-server at {address}\n\n> {PROMPT}\n", file=sys.stderr, flush=True)
        return subprocess.call([sys.executable, "-m", "edge_client.cli", "--server", address,
                                "--max-new-tokens", "160", PROMPT])
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
