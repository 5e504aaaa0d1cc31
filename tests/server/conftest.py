"""A live `appliance serve` in a subprocess on 127.0.0.1 (free port, tiny model), for the server tests."""
from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, model_dir: Path, *args: str, env: dict | None = None, startup_timeout: float = 180,
                 tls_ca: str | None = None):
        """``tls_ca``: the server speaks HTTPS (--ssl-*) with a certificate this CA file verifies."""
        self.port = free_port()
        self.base_url = f"{'https' if tls_ca else 'http'}://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="appliance-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "appliance.cli", "serve", str(model_dir), "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
        verify = ssl.create_default_context(cafile=tls_ca) if tls_ca else True
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.output()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=1, verify=verify).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy after {startup_timeout} s:\n{self.output()}")
            time.sleep(0.2)

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server_model_dir(llama_dir):
    return llama_dir


@pytest.fixture(scope="session")
def start_server():
    """Factory: start_server(model_dir, *cli_args, env=None) -> a healthy ServerProcess."""
    return ServerProcess
