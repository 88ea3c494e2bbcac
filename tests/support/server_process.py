"""`pyml serve` started for a test: in a subprocess, on a free port of 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx  # the HTTP client the openai package itself depends on
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def started(folder: Path, *options: str):
    """(the process, its base URL) once `pyml serve --model folder` answers /health. The lines it
    writes (stdout and stderr) gather in `process.output` as they come."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    process = subprocess.Popen(
        [sys.executable, "-m", "pyml.cli", "serve", "--model", str(folder), "--port", str(port), *options],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    process.output = []

    def gather() -> None:
        for line in process.stdout:
            process.output.append(line)

    reader = threading.Thread(target=gather, daemon=True)
    reader.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            reader.join(timeout=10)
            pytest.fail(f"pyml serve did not start: {''.join(process.output)[-3000:]}")
        time.sleep(0.2)
    return process, url
