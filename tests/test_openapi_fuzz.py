"""Issue 25: schemathesis, the OpenAPI fuzzer, against the spec the server itself serves
(`/openapi.json`, whose POST bodies are the protocol's request models: server/openapi.py), on a real
uvicorn server on loopback. Bounded (examples per operation, one worker, a subprocess timeout), seeded, and
with the one check the issue asks for: no response is a server error. The server's own request
counter then shows what was sent and that no 5xx was answered. `CLOVER_SCHEMATHESIS_EXAMPLES` raises
the bound for a longer run."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import httpx
import pytest

pytest.importorskip("schemathesis")

from clover.engine import Engine, EngineOptions  # noqa: E402
from clover.server.app import create_app  # noqa: E402
from test_server import MODEL, Server, model, model_dir, tokenizer  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py
EXAMPLES = int(os.environ.get("CLOVER_SCHEMATHESIS_EXAMPLES", "20"))     # ~600 requests, ~40 s


@pytest.fixture(scope="module")
def fuzzed(model, tokenizer):
    engine = Engine(model, EngineOptions(max_batch=8, max_queue=16))
    server = Server(create_app(engine, tokenizer, MODEL))
    yield server, engine
    assert server.stop()


def answered(metrics: str) -> dict[tuple[str, str], int]:
    """(route, status) → requests answered, from /metrics."""
    out = {}
    for route, status, n in re.findall(r'_http_requests_total\{route="([^"]*)",status="(\d+)"\} (\d+)', metrics):
        out[(route, status)] = out.get((route, status), 0) + int(float(n))
    return out


def test_served_spec_describes_the_request_bodies(fuzzed):
    server, _ = fuzzed
    spec = httpx.get(server.url + "/openapi.json").json()
    for path, required in (("/v1/chat/completions", {"model", "messages"}), ("/v1/completions", {"model", "prompt"})):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        schema = body["schema"]
        assert set(schema["required"]) == required and "$ref" not in str(schema), path
        assert schema["additionalProperties"] is True          # the block-diffusion settings ride as extras
        assert schema["properties"]["model"]["enum"] == [MODEL]
        r = httpx.post(server.url + path, json=body["example"], timeout=60)     # the example is a working request
        assert r.status_code == 200, r.text


def test_schemathesis_finds_no_server_error(fuzzed, tmp_path):
    server, engine = fuzzed
    command = [sys.executable, "-c", "import sys; from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
               "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", str(EXAMPLES),
               "--seed", "25", "--workers", "1", "--request-timeout", "60",
               "--generation-database", "none", "--suppress-health-check", "all", "--no-color"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=420, cwd=tmp_path,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    counts = answered(httpx.get(server.url + "/metrics").text)
    assert not [k for k in counts if k[1].startswith("5")], counts
    for route in ("/v1/chat/completions", "/v1/completions"):
        assert sum(n for (r, s), n in counts.items() if r == route and s.startswith("4")) >= 10, counts
        assert counts.get((route, "200"), 0) >= 1, (counts, out.stdout[-4000:])     # and some fuzzed requests were served
    assert httpx.get(server.url + "/health").status_code == 200 and engine.batch_size == 0
