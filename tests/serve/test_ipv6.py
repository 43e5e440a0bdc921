"""`dynalm serve --host` with IPv6 addresses (issue 25): ``::1``, ``::`` and ``[::1]`` bind,
print the URL with the address in brackets, and answer a real connection over ``::1``."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest
from serving import live_server, server_process

from dynalm.errors import InvalidRequest
from dynalm.models.loader import LoadedModel
from dynalm.runtime.serve.server import bind_socket, url_of


def _has_ipv6_loopback() -> bool:
    try:  # the kernel lists ::1 (on lo) when IPv6 is up
        return any(line.startswith("0" * 31 + "1 ") for line in open("/proc/net/if_inet6"))
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback (::1)")


@pytest.mark.parametrize(
    ("host", "url"), [("::1", "http://[::1]:"), ("[::1]", "http://[::1]:"), ("::", "http://[::]:")]
)
def test_an_ipv6_host_binds_and_its_url_has_brackets(host: str, url: str):
    sock = bind_socket(host, 0)
    try:
        assert sock.family == socket.AF_INET6
        port = sock.getsockname()[1]
        assert url_of(sock) == f"{url}{port}"
        with socket.create_connection(("::1", port), timeout=10):  # accepted by the backlog
            pass
    finally:
        sock.close()


def test_a_host_that_is_no_address_is_one_error_naming_it():
    with pytest.raises(InvalidRequest, match=r"^--host 'no such host\.invalid': "):
        bind_socket("no such host.invalid", 0)


def test_the_server_answers_over_ipv6_loopback(smollm2: LoadedModel):
    with live_server(smollm2, host="::") as server:
        port = server.url.rsplit(":", 1)[1]
        assert server.url.startswith("http://[::]:")
        models = httpx.get(f"http://[::1]:{port}/v1/models", timeout=30)
        assert models.status_code == 200 and models.json()["data"]


def test_dynalm_serve_host_bracketed_ipv6(smollm2_gguf: Path, tmp_path: Path):
    cmd = ["-m", "dynalm.cli", "serve", str(smollm2_gguf), "--host", "[::1]", "--port", "0"]
    with server_process(cmd, tmp_path / "stderr.txt") as server:
        assert server.url.startswith("http://[::1]:"), server.url
        assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": smollm2_gguf.stem, "prompt": "Hi", "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
