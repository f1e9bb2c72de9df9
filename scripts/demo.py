"""`make demo`: a local cloud-server on a free port, and the edge client answering one prompt
twice: through the server's plain API (the target alone, one token a forward: the baseline),
then with split decoding, streamed live; the last line compares the two runs' speed and text."""
from __future__ import annotations

import re
import signal
import subprocess
import sys

PROMPT = "Explain in a few sentences why the sky is blue, then list three related facts."
MAX_NEW_TOKENS = "160"
SPEED = re.compile(r" ([0-9.]+) tok/s")


def answer(address: str, mode: str) -> tuple[str, float]:
    """Runs the edge client once in `mode`, its text streamed to the terminal; returns the
    text and the tokens a second its stats line reports."""
    print(f"\n--- {mode} ---", file=sys.stderr, flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "edge_client.cli", "--server", address,
                             "--mode", mode, "--max-new-tokens", MAX_NEW_TOKENS, PROMPT],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    text = []
    for chunk in iter(lambda: proc.stdout.read(1), ""):
        text.append(chunk)
        sys.stdout.write(chunk)
        sys.stdout.flush()
    errors = proc.stderr.read()
    sys.stderr.write(errors)
    if proc.wait() != 0:
        raise RuntimeError(f"edge-client --mode {mode} failed")
    speeds = SPEED.findall(errors)
    return "".join(text), float(speeds[-1]) if speeds else 0.0


def main() -> int:
    print("starting cloud-server (the first start converts the embedded model and builds the "
          "MoA drafter bundle, about a minute)...", file=sys.stderr, flush=True)
    server = subprocess.Popen([sys.executable, "-m", "cloud_server.cli", "--port", "0"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        if not line.startswith("listening on "):
            print(f"demo: cloud-server did not start ({line!r})", file=sys.stderr)
            return 1
        address = line.removeprefix("listening on ")
        print(f"cloud-server at {address}\n\n> {PROMPT}", file=sys.stderr, flush=True)
        plain_text, plain_speed = answer(address, "plain-api")
        split_text, split_speed = answer(address, "split")
        same = "the same text" if split_text == plain_text else "DIFFERENT text"
        ratio = split_speed / plain_speed if plain_speed else float("nan")
        print(f"\nsplit decoding {split_speed:.1f} tok/s, plain API {plain_speed:.1f} tok/s: "
              f"{ratio:.2f}x, {same}", file=sys.stderr)
        return 0 if split_text == plain_text else 1
    except RuntimeError as err:
        print(f"demo: {err}", file=sys.stderr)
        return 1
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
