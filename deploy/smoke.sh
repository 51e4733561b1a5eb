#!/usr/bin/env bash
# End-to-end smoke test of the compose deployment, on any Docker host (make compose-smoke):
# build the image, start jaeger, prefill, decode and gateway, wait until compose reports them
# healthy, send one chat prompt long enough to be prefilled by the prefill worker (not on the
# decode worker: see the gateway's disagg_threshold), take the response's x-trace-id and check,
# through Jaeger's query API, that the trace holds the gateway, prefill and decode spans with the
# KV transfer between them; then tear everything down. Every check exits non-zero, saying why.
#
#   deploy/smoke.sh            # CPU: compose.yaml + compose.cpu.yaml (BASE_IMAGE: a CPU torch base)
#   deploy/smoke.sh gpu        # compose.yaml alone: the host's GPU (NVIDIA Container Toolkit)
#
# Variables: BASE_IMAGE, JAEGER_IMAGE (compose's own), SMOKE_PROJECT (the compose project name,
# default tandem-smoke: a running `tandem` project is left alone), SMOKE_HEALTHY_TIMEOUT (s, 900),
# SMOKE_TRACE_TIMEOUT (s, 60), SMOKE_KEEP=1 (leave the services up for a look).
#
# The request and the trace query run inside the gateway container, on the compose network
# (http://127.0.0.1:8000, http://jaeger:16686): no published port is used, so the smoke test
# runs beside a local `tandem up` and against a remote DOCKER_HOST alike; the published ports are
# removed for the run (an override file written to a temporary folder).
set -euo pipefail
cd "$(dirname "$0")/.."

variant=${1:-cpu}
case "$variant" in
  cpu) files=(-f compose.yaml -f compose.cpu.yaml) ;;
  gpu) files=(-f compose.yaml) ;;
  *) echo "usage: $0 [cpu|gpu]" >&2; exit 2 ;;
esac
project=${SMOKE_PROJECT:-tandem-smoke}
healthy_timeout=${SMOKE_HEALTHY_TIMEOUT:-900}
trace_timeout=${SMOKE_TRACE_TIMEOUT:-60}

t0=$(date +%s)
say() { echo "=== [$(($(date +%s) - t0))s] $*"; }
fail() { echo "smoke: FAILED: $*" >&2; exit 1; }

command -v docker >/dev/null || fail "docker is not on PATH"
docker compose version >/dev/null 2>&1 || fail "Docker Compose v2 (docker compose) is not installed"
docker info >/dev/null 2>&1 || fail "no Docker engine answers (DOCKER_HOST=${DOCKER_HOST:-default})"

tmp=$(mktemp -d)
cat >"$tmp/no-ports.yaml" <<'EOF'
services:
  gateway:
    ports: !reset []
  jaeger:
    ports: !reset []
EOF
dc() { docker compose -p "$project" "${files[@]}" -f "$tmp/no-ports.yaml" "$@"; }

cleanup() {
  rc=$?
  if [ "$rc" -ne 0 ]; then
    echo "--- the services' last log lines" >&2
    dc ps -a >&2 || true
    dc logs --no-color --tail 40 >&2 || true
  fi
  if [ "${SMOKE_KEEP:-0}" = 1 ]; then
    say "SMOKE_KEEP=1: left up (docker compose -p $project ${files[*]} down)"
  else
    say "down"
    dc down --remove-orphans --volumes --timeout 20 >/dev/null 2>&1 || echo "smoke: docker compose down failed" >&2
  fi
  rm -rf "$tmp"
  exit "$rc"
}
trap cleanup EXIT

say "build ($variant: ${files[*]})"
s=$(date +%s)
dc build || fail "docker compose build failed"
build_s=$(($(date +%s) - s))
say "built in ${build_s}s"

say "up: waiting until every service is healthy (at most ${healthy_timeout}s)"
s=$(date +%s)
dc up -d --wait --wait-timeout "$healthy_timeout" || fail "the services did not all become healthy"
healthy_s=$(($(date +%s) - s))
say "healthy in ${healthy_s}s"
dc ps --format '{{.Service}}: {{.Status}}'

say "chat request through the gateway, then its trace from Jaeger"
dc exec -T -e TRACE_TIMEOUT="$trace_timeout" gateway python - <<'PY' || fail "the request or its trace check failed (above)"
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request


def fail(msg):
    print(f"smoke: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


# Well over the gateway's disagg_threshold (128 tokens by default): the prefill worker computes
# it and the decode worker imports its KV (kv.transfer).
text = " ".join(
    f"Note {i}: the river town kept its ledgers in the old stone hall by the bridge." for i in range(30)
)
body = {
    "messages": [{"role": "user", "content": text + "\nIn one sentence, where were the ledgers kept?"}],
    "max_tokens": 16,
    "temperature": 0,
}
req = urllib.request.Request(
    "http://127.0.0.1:8000/v1/chat/completions",
    data=json.dumps(body).encode(),
    headers={"Content-Type": "application/json"},
)
t = time.monotonic()
try:
    with urllib.request.urlopen(req, timeout=300) as r:
        status, headers, reply = r.status, r.headers, json.load(r)
except urllib.error.HTTPError as e:
    fail(f"POST /v1/chat/completions answered {e.code}: {e.read().decode(errors='replace')}")
except OSError as e:
    fail(f"POST /v1/chat/completions: {e}")
took = time.monotonic() - t
content = reply["choices"][0]["message"]["content"]
usage = reply.get("usage", {})
print(f"reply in {took:.1f}s, {usage}: {content!r}")
if status != 200 or not content.strip():
    fail(f"status {status}, empty reply")
if usage.get("prompt_tokens", 0) <= 128:
    fail(f"the prompt has {usage.get('prompt_tokens')} tokens: too short for the prefill worker")
trace_id = headers.get("x-trace-id", "")
if not re.fullmatch(r"[0-9a-f]{32}", trace_id):
    fail(f"no x-trace-id header in the response (got {trace_id!r}): is tracing on?")
print("x-trace-id", trace_id)

want_services = {"tandem-gateway", "tandem-prefill", "tandem-decode"}
want_spans = {"gateway.request", "prefill.forward", "kv.transfer", "decode.generate"}
deadline = time.monotonic() + float(os.environ["TRACE_TIMEOUT"])
seen = {}
while True:
    try:
        with urllib.request.urlopen(f"http://jaeger:16686/api/traces/{trace_id}", timeout=10) as r:
            data = json.load(r).get("data") or []
    except urllib.error.HTTPError as e:  # Jaeger: 404 until the first span arrives
        if e.code != 404:
            fail(f"Jaeger /api/traces/{trace_id} answered {e.code}")
        data = []
    except OSError as e:
        fail(f"Jaeger's query API (http://jaeger:16686) cannot be reached: {e}")
    seen = {}
    for trace in data:
        processes = trace.get("processes") or {}
        for span in trace.get("spans", []):
            # Jaeger names the service through processes; the stand-in sink on the span.
            svc = span.get("service") or processes.get(span.get("processID"), {}).get("serviceName", "")
            seen.setdefault(svc, set()).add(span["operationName"])
    spans = set().union(*seen.values()) if seen else set()
    if want_services <= set(seen) and want_spans <= spans:
        break
    if time.monotonic() > deadline:
        fail(
            f"trace {trace_id} lacks services {sorted(want_services - set(seen))} and spans "
            f"{sorted(want_spans - spans)} after {os.environ['TRACE_TIMEOUT']}s; it holds {seen}"
        )
    time.sleep(1)
for svc in sorted(seen):
    print(f"trace {svc}: {', '.join(sorted(seen[svc]))}")
PY
say "PASSED: built in ${build_s}s, healthy in ${healthy_s}s, request and trace checked"
