"""The command line: `tandem up` checks every flag before it starts anything, and says where each
goes; `tandem chat` explains what to do when nothing listens."""

from __future__ import annotations

import argparse
import socket
import time

import pytest

from tandem import up as up_module
from tandem.cli import main
from tandem.rpc import api_pb2_grpc
from tandem.up import WORKER_PORT_STRIDE, _stage_argv, _workers, default_prefill_workers
from tandem.up import add_up_args as _add_up_args
from tests.conftest import self_signed_cert


def _up_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    _add_up_args(p)
    return p.parse_args(argv)


def test_up_help_lists_the_stage_flags_grouped_with_defaults(capsys):
    with pytest.raises(SystemExit) as e:
        main(["up", "--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for heading in ("engine settings", "gateway settings", "prefill worker settings"):
        assert heading in text
    for flag in ("--num-blocks", "--kv-dtype", "--device", "--disagg-threshold", "--lease-ttl"):
        assert flag in text
    flat = " ".join(text.split())
    assert "(default 16; TANDEM_BLOCK_SIZE)" in flat
    assert "(default on for a CUDA device, off on CPU; TANDEM_ASYNC_SCHEDULING)" in flat


@pytest.mark.parametrize(
    "argv, env, want",
    [([], None, None), (["--async-scheduling", "false"], "true", False), ([], "on", True)],
)
def test_async_scheduling_unset_or_set_by_flag_or_variable(argv, env, want, monkeypatch):
    """A bool that may stay unset (None: chosen by the device) parses like any bool."""
    from tandem.config import EngineConfig
    from tandem.config_options import add_dataclass_args, dataclass_from_args

    if env is None:
        monkeypatch.delenv("TANDEM_ASYNC_SCHEDULING", raising=False)
    else:
        monkeypatch.setenv("TANDEM_ASYNC_SCHEDULING", env)
    parser = argparse.ArgumentParser()
    add_dataclass_args(parser, EngineConfig, "engine")
    config = dataclass_from_args(EngineConfig, parser.parse_args(argv))
    assert config.async_scheduling is want


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-blokcs", "8"], "unrecognized arguments: --num-blokcs"),
        (["--dtype", "float8"], "dtype must be one of"),
        (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
        (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such file"),
        (["--ttft-slo-ms", "-3"], "ttft_slo_ms must be > 0"),
        (["--decode-workers", "0"], "--decode-workers must be >= 1, got 0"),
        (["--prefill-workers", "-1"], "--prefill-workers must be >= 0, got -1"),
        (
            ["--prefill-workers", "0", "--prefill-device", "cuda:1"],
            "--prefill-device: --prefill-workers 0 starts no prefill worker",
        ),
        (["--device", "cpu,cuda:x"], "--device: device must be auto, cpu, cuda, cuda:N or mps"),
        (["--decode-device", "cuda:1,tpu"], "--decode-device: device must be"),
        (
            ["--port", "50100", "--prefill-workers", "2", "--decode-port", "50111"],
            "two stages would listen on 127.0.0.1:50111",
        ),
    ],
)
def test_up_refuses_a_bad_flag_at_once(argv, message, capsys, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as e:
        main(["up", "--log-dir", str(tmp_path), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert time.monotonic() - t0 < 5  # before any stage starts (a stage takes longer to load)
    assert not list(tmp_path.glob("*.log"))


def test_up_refuses_a_port_in_use(capsys, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SystemExit):
            main(["up", "--log-dir", str(tmp_path), "--prefill-port", str(port)])
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_up_passes_each_setting_to_the_stages_that_take_it():
    argv = _stage_argv(
        _up_args(
            ["--num-blocks", "64", "--disagg-threshold", "0", "--lease-ttl", "5", "--no-restart"]
        )
    )
    for stage in ("prefill", "decode", "gateway", "draft"):
        assert argv[stage][:2] == ["--num-blocks", "64"]
    assert "--disagg-threshold" in argv["gateway"] and "--disagg-threshold" not in argv["decode"]
    assert "--lease-ttl" in argv["prefill"] and "--lease-ttl" not in argv["decode"]
    # Each stage's own parser accepts what it is given.
    from tandem.stage_args import stage_parser

    for stage, args in argv.items():
        extra = ["--prefill", "a:1", "--decode", "b:2"] if stage == "gateway" else []
        stage_parser(stage).parse_args([*args, *extra])


def test_up_gives_each_worker_its_ports_and_a_device_in_turn():
    base = {"prefill": 100, "decode": 200}
    metrics = {"prefill": 1100, "decode": 1200}
    args = _up_args(
        ["--prefill-workers", "2", "--decode-workers", "3", "--device", "cuda:0,cuda:1"]
    )
    got = [(w.name, w.port, w.metrics_port, w.device) for w in _workers(args, base, metrics)]
    s = WORKER_PORT_STRIDE
    assert got == [
        ("prefill0", 100, 1100, "cuda:0"),
        ("prefill1", 100 + s, 1100 + s, "cuda:1"),
        ("decode0", 200, 1200, "cuda:0"),
        ("decode1", 200 + s, 1200 + s, "cuda:1"),
        ("decode2", 200 + 2 * s, 1200 + 2 * s, "cuda:0"),
    ]
    # None of a stage: the decode workers prefill every prompt.
    args = _up_args(["--prefill-workers", "0", "--decode-workers", "2"])
    got = [(w.name, w.port) for w in _workers(args, base, metrics)]
    assert got == [("decode0", 200), ("decode1", 200 + s)]
    # A stage's own list rules its workers; one device (or none) reaches every stage as it is.
    args = _up_args(["--decode-workers", "2", "--decode-device", "cuda:3,cuda:2"])
    got = [(w.name, w.device) for w in _workers(args, base, dict.fromkeys(base, -1))]
    assert got == [("prefill", None), ("decode0", "cuda:3"), ("decode1", "cuda:2")]
    assert {w.metrics_port for w in _workers(args, base, dict.fromkeys(base, -1))} == {-1}


@pytest.mark.parametrize(
    ("flags", "gpu", "want"),
    [
        # Stages sharing one GPU: the decode worker prefills, no second process time-slices it.
        ([], True, 0),
        (["--device", "cuda"], False, 0),
        (["--device", "cuda:1", "--decode-workers", "2"], True, 0),
        # The CPU, or devices of their own: a prefill worker.
        ([], False, 1),
        (["--device", "cpu"], True, 1),
        (["--device", "cuda:0,cuda:1"], True, 1),
        (["--decode-device", "cuda:1"], True, 1),
        (["--device", "cuda:0", "--decode-device", "cuda:1"], True, 1),
        # A setting only a prefill worker takes asks for one.
        (["--prefill-device", "cuda:0"], True, 1),
        (["--prefill-port", "50111"], True, 1),
        (["--disagg-threshold", "0"], True, 1),
        (["--kv-transport", "cuda_ipc"], True, 1),
    ],
)
def test_up_starts_a_prefill_worker_unless_the_stages_share_one_gpu(monkeypatch, flags, gpu, want):
    monkeypatch.setattr(up_module, "_host_has_gpu", lambda: gpu)
    args = _up_args(flags)
    assert args.prefill_workers is None  # not given: `tandem up` chooses
    got, why = default_prefill_workers(args)
    assert (got, bool(why)) == (want, True)


def test_up_sees_a_gpu_host_as_torch_does():
    import torch

    assert up_module._host_has_gpu() == torch.cuda.is_available()


def test_chat_with_nothing_listening_says_to_start_tandem(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        rc = main(["chat", "hi", "--port", str(port)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "UNAVAILABLE" in err and "tandem up" in err and f"127.0.0.1:{port}" in err


@pytest.mark.parametrize(
    "argv, address",
    [
        (["--port", "70000"], "127.0.0.1:7000"),  # a stage port from 70000 up
        (["--port", "-1"], "127.0.0.1:"),
        (["--port", "50061", "--http-port", "65536"], "127.0.0.1:65536"),
    ],
)
def test_up_refuses_a_port_outside_the_range_by_name(argv, address, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["up", "--log-dir", str(tmp_path), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"cannot listen on {address}" in err
    assert "a port must be in 1-65535" in err
    assert "Traceback" not in err
    assert not list(tmp_path.glob("*.log"))


def test_chat_in_plaintext_to_a_tls_gateway_says_to_give_its_ca(capsys, tmp_path):
    # A TLS server closes a plaintext connection at once; "nothing answers, start Tandem" would
    # send the user to start a second one.
    from concurrent import futures

    import grpc

    key, cert = self_signed_cert(tmp_path)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_GatewayServicer_to_server(_KeyCheckingGateway("k", None), server)
    (tmp_path / "key").write_text("k\n")
    creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        assert main(["chat", "hi", "--port", str(port)]) == 1
        err = capsys.readouterr().err
        assert "--tls-ca" in err and "tandem up" not in err, err
        tls = ["--tls-ca", str(cert), "--api-key-file", str(tmp_path / "key")]
        assert main(["chat", "hi", "--port", str(port), *tls]) == 0
        assert capsys.readouterr().out.startswith("ok")
    finally:
        server.stop(None)


def test_chat_with_a_missing_ca_file_says_so(capsys, tmp_path):
    missing = tmp_path / "no-such-ca.pem"
    rc = main(["chat", "hi", "--port", "1", "--tls-ca", str(missing)])
    assert rc == 2
    assert f"--tls-ca {missing}: No such file or directory" in capsys.readouterr().err


class _KeyCheckingGateway(api_pb2_grpc.GatewayServicer):
    """A gateway that answers Generate only with a key its tenant table (the gateway's own
    `TenantAuth`) accepts, as the real one does."""

    def __init__(self, api_key: str | None, api_keys: dict[str, str] | None) -> None:
        from services.gateway.tenants import TenantAuth

        super().__init__()
        self.auth = TenantAuth(api_key, api_keys)

    def Generate(self, request, context):  # noqa: N802 - the gRPC method's name
        import grpc

        from tandem.rpc import api_pb2

        md = dict(context.invocation_metadata())
        if self.auth.tenant_of_key(md.get("authorization", "")) is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key")
        yield api_pb2.GenerateResponse(chunk=api_pb2.Chunk(text="ok"))
        yield api_pb2.GenerateResponse(finish=api_pb2.Finish(finish_reason="stop"))


def _serve(servicer):
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def test_chat_sends_the_api_key_from_its_file(capsys, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("s3cret-key\n")
    server, port = _serve(_KeyCheckingGateway("s3cret-key", None))
    try:
        assert main(["chat", "hi", "--port", str(port)]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert main(["chat", "hi", "--port", str(port), "--api-key-file", str(key_file)]) == 0
        assert capsys.readouterr().out.startswith("ok")
    finally:
        server.stop(None)


@pytest.mark.parametrize("flag", ["--api-key-file", "--api-keys"])
def test_then_chat_uses_a_key_the_gateway_accepts(flag, tmp_path):
    from tandem.up import _then_chat_key

    key_file = tmp_path / "keys"
    if flag == "--api-key-file":
        key_file.write_text("only-key\n")
        gateway = _KeyCheckingGateway("only-key", None)
    else:
        key_file.write_text("# tenant key\nteam-a key-a\nteam-b key-b\n")
        gateway = _KeyCheckingGateway(None, {"key-a": "team-a", "key-b": "team-b"})
    key = _then_chat_key(_up_args([flag, str(key_file)]))
    server, port = _serve(gateway)
    try:
        from tandem.chat import cmd_chat

        assert cmd_chat(_chat_args(port, key)) == 0
    finally:
        server.stop(None)


def _chat_args(port: int, api_key: str | None) -> argparse.Namespace:
    return argparse.Namespace(
        message="hi",
        address=f"127.0.0.1:{port}",
        port=None,
        tls_ca=None,
        max_tokens=4,
        temperature=0.0,
        system=None,
        seed=None,
        api_key=api_key,
    )


def _procs(args: argparse.Namespace, draft_device: str | None = None) -> list:
    """(stage, name, own flags, metrics port) of each process, as `tandem up` lists them."""
    workers = _workers(args, {"prefill": 100, "decode": 200}, {"prefill": -1, "decode": -1})
    procs = [("draft", "draft", ["--device", draft_device] if draft_device else [], -1)]
    procs += [(w.stage, w.name, ["--device", w.device] if w.device else [], -1) for w in workers]
    return procs + [("gateway", "gateway", [], -1)]


@pytest.mark.parametrize(
    ("flags", "draft_device", "want"),
    [
        # A prefill and a decode worker (and a model draft) on the host's one GPU share it.
        (["--prefill-workers", "1", "--draft", "self:4"], None,
         {"draft": 0.3, "prefill": 0.3, "decode": 0.3}),
        # A given fraction is divided; prompt lookup holds no model.
        (["--prefill-workers", "1", "--gpu-memory-utilization", "0.8", "--draft", "ngram"],
         None, {"prefill": 0.4, "decode": 0.4}),
        # Per device: the draft alone on its GPU keeps the whole fraction.
        (["--prefill-workers", "0", "--decode-workers", "2", "--device", "cuda:1",
          "--draft", "self:4"], "cuda:0", {"decode0": 0.45, "decode1": 0.45}),
        # Devices of their own, the CPU, or a pool size given: nothing to divide.
        (["--prefill-device", "cuda:0", "--decode-device", "cuda:1"], None, {}),
        (["--prefill-workers", "1", "--device", "cpu"], None, {}),
        (["--prefill-workers", "1", "--num-blocks", "64"], None, {}),
        (["--prefill-workers", "1", "--kv-cache-memory-gb", "8"], None, {}),
    ],
)  # fmt: skip
def test_up_divides_the_memory_of_a_shared_gpu(flags, draft_device, want, monkeypatch):
    """Workers that size their KV pools by a share of their GPU's memory would each take the
    whole share: `tandem up` gives the workers on one device equal parts of it."""
    monkeypatch.setattr(up_module, "_host_has_gpu", lambda: True)
    for var in ("TANDEM_NUM_BLOCKS", "TANDEM_KV_CACHE_MEMORY_GB", "TANDEM_GPU_MEMORY_UTILIZATION"):
        monkeypatch.delenv(var, raising=False)
    args = _up_args(flags)
    procs = _procs(args, draft_device)
    if not args.draft:
        procs = procs[1:]
    got = {name: share for name, share, _ in up_module._memory_shares(args, procs)}
    assert got == pytest.approx(want, abs=1e-4)
    for _, name, own, _ in procs:  # each share is the last flag of the worker's own command
        if name in want:
            assert own[-2:] == ["--gpu-memory-utilization", str(got[name])]
        else:
            assert "--gpu-memory-utilization" not in own
    # The variables count as the flags do.
    monkeypatch.setenv("TANDEM_NUM_BLOCKS", "64")
    assert up_module._memory_shares(_up_args(flags), _procs(_up_args(flags), draft_device)) == []
