"""`make demo`'s last step: serve a model folder with `pyml serve` on a free local port, ask it one
question through the official openai client, print the streamed answer, and stop the server with
SIGTERM (it drains and exits 0).

    python demo/ask_served.py MODEL_DIR "QUESTION"
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

from openai import OpenAI


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(model_dir: str, question: str) -> int:
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "pyml.cli", "serve", "--model", model_dir,
                               "--port", str(port)])
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    print("pyml serve did not start", file=sys.stderr)
                    return 1
                time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        print(f"POST /v1/chat/completions (stream) to pyml serve --model {model_dir}:")
        stream = client.chat.completions.create(model=model_dir, messages=[{"role": "user", "content": question}],
                                                max_tokens=48, temperature=0, stream=True)
        for chunk in stream:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        print()
    finally:
        server.terminate()
        status = server.wait(timeout=60)
    return status


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
