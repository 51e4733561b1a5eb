"""The command line: `tandem up` checks every flag before it starts anything, and says where each
goes; `tandem chat` explains what to do when nothing listens."""

from __future__ import annotations

import argparse
import json
import math
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


# The settings a worker's share is sized by: a test sets them by its flags alone.
SIZING_VARS = ("NUM_BLOCKS", "KV_CACHE_MEMORY_GB", "GPU_MEMORY_UTILIZATION", "MODEL", "DTYPE",
               "KV_DTYPE", "MAX_NUM_BATCHED_TOKENS", "MAX_NUM_SEQS", "MAX_MODEL_LEN")  # fmt: skip


@pytest.fixture
def gpu_host(monkeypatch):
    """A host with one 80 GiB GPU and none of the sizing variables set; returns a function that
    sets the device's memory (None: unreadable)."""
    monkeypatch.setattr(up_module, "_host_has_gpu", lambda: True)
    for var in SIZING_VARS:
        monkeypatch.delenv(f"TANDEM_{var}", raising=False)

    def device_memory(gib: float | None) -> None:
        total = None if gib is None else int(gib * 2**30)
        monkeypatch.setattr(up_module, "_gpu_total_memory", lambda device: total)

    device_memory(80)
    return device_memory


def _shares(flags: list[str], draft_device: str | None = None) -> dict[str, tuple[float, str]]:
    """{worker: (its share, why)} as `tandem up` would give them for `flags`."""
    args = _up_args(flags)
    procs = _procs(args, draft_device)
    if not args.draft:
        procs = procs[1:]
    got = up_module._memory_shares(args, procs)
    for _, name, own, _ in procs:  # each share is the last flag of the worker's own command
        share = [s for n, s, _, _ in got if n == name]
        if share:
            assert own[-2:] == ["--gpu-memory-utilization", str(share[0])]
        else:
            assert "--gpu-memory-utilization" not in own
    return {name: (share, why) for name, share, _, why in got}


@pytest.mark.parametrize(
    ("flags", "draft_device", "want"),
    [
        # A prefill and a decode worker (and a model draft) on the host's one GPU share it: the
        # prefill worker gets what it needs. SmolLM2-135M (tied embedding, 134,515,008
        # parameters: 0.27 GB in bfloat16), 1 GiB outside torch, 0.68 GB of activations
        # (8192 tokens a step, 256 sequences) and KV for 16384 tokens (2 steps; 23,040 bytes a
        # token: 0.38 GB), 5% over: 2.52 GB, 0.0294 of 80 GiB (rounded up). The draft keeps its
        # equal part.
        (["--prefill-workers", "1", "--draft", "self:4"], None,
         {"draft": 0.3, "prefill": 0.0294, "decode": 0.9 - 0.3 - 0.0294}),
        # A given fraction is divided; prompt lookup holds no model.
        (["--prefill-workers", "1", "--gpu-memory-utilization", "0.8", "--draft", "ngram"],
         None, {"prefill": 0.0294, "decode": 0.8 - 0.0294}),
        # Per device: the draft alone on its GPU keeps the whole fraction; decode workers alone
        # on theirs get equal parts.
        (["--prefill-workers", "0", "--decode-workers", "2", "--device", "cuda:1",
          "--draft", "self:4"], "cuda:0", {"decode0": 0.45, "decode1": 0.45}),
        # Devices of their own, the CPU, or a pool size given: nothing to divide.
        (["--prefill-device", "cuda:0", "--decode-device", "cuda:1"], None, {}),
        (["--prefill-workers", "1", "--device", "cpu"], None, {}),
        (["--prefill-workers", "1", "--num-blocks", "64"], None, {}),
        (["--prefill-workers", "1", "--kv-cache-memory-gb", "8"], None, {}),
    ],
)  # fmt: skip
def test_up_divides_the_memory_of_a_shared_gpu(flags, draft_device, want, gpu_host, monkeypatch):
    """Workers that size their KV pools by a share of their GPU's memory would each take the
    whole share: `tandem up` divides it among the workers on one device."""
    got = {name: share for name, (share, _) in _shares(flags, draft_device).items()}
    assert got == pytest.approx(want, abs=1e-4)
    # The variables count as the flags do.
    monkeypatch.setenv("TANDEM_NUM_BLOCKS", "64")
    assert up_module._memory_shares(_up_args(flags), _procs(_up_args(flags), draft_device)) == []


def _llama3_8b(directory) -> str:
    """A Llama-3-8B config.json (no weights) in `directory`; returns its path."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def _llama3_8b_prefill_bytes(tokens: int, kv_bytes: int, step_tokens: int = 8192) -> float:
    """What a Llama-3-8B prefill worker needs, in bfloat16 with 256 sequences: its weights, 1 GiB
    outside torch, a step's activations, a pool of `tokens` tokens, 5% over."""
    from tandem.kv.sizing import ModelShape, activation_bytes

    h, inter, layers, kv_heads, head_dim, vocab = 4096, 14336, 32, 8, 128, 128256
    per_layer = 2 * h * h + 2 * h * kv_heads * head_dim + 3 * h * inter + 2 * h
    params = 2 * vocab * h + layers * per_layer + h  # embedding, layers, final norm, LM head
    assert params == 8_030_261_248
    shape = ModelShape(h, inter, 32, kv_heads, head_dim, vocab)
    activations = activation_bytes(shape, step_tokens, 256, 2)
    pool = tokens * 2 * layers * kv_heads * head_dim * kv_bytes
    return (2 * params + 2**30 + activations + pool) * 1.05


@pytest.mark.parametrize(
    ("flags", "env", "tokens", "kv_bytes", "step_tokens"),
    [
        ([], {}, 16384, 2, 8192),  # two steps of 8192 tokens, over one 8192-token prompt
        (["--kv-dtype", "fp8", "--max-num-batched-tokens", "2048"], {}, 8192, 1, 2048),
        ([], {"TANDEM_MAX_NUM_BATCHED_TOKENS": "1024", "TANDEM_KV_DTYPE": "int8"}, 8192, 1, 1024),
    ],
)
def test_up_gives_a_prefill_worker_what_it_needs_of_a_shared_gpu(
    flags, env, tokens, kv_bytes, step_tokens, gpu_host, monkeypatch, tmp_path
):
    """A prefill worker hands each prompt's KV to the decode worker and frees it: beside the
    decode worker on one GPU it gets its weights, activations and a pool of one longest prompt
    or two steps, and the decode worker, whose pool holds every running sequence, the rest."""
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    model = _llama3_8b(tmp_path)
    got = _shares(["--prefill-workers", "1", "--model", model, *flags])
    need = math.ceil(_llama3_8b_prefill_bytes(tokens, kv_bytes, step_tokens) / 80 / 2**30 * 1e4)
    assert got["prefill"][0] == need / 1e4
    assert got["decode"][0] == pytest.approx(0.9 - need / 1e4, abs=1e-4)
    assert got["prefill"][0] + got["decode"][0] <= 0.9
    assert "weights 15.0 GiB" in got["prefill"][1] and f"for {tokens} tokens" in got["prefill"][1]
    assert "the rest of 0.9 after" in got["decode"][1]


def test_up_keeps_a_draft_equal_part_beside_a_prefill_worker(gpu_host, tmp_path):
    """A model draft on the same GPU keeps the equal part it would have among three."""
    model = _llama3_8b(tmp_path)
    got = _shares(["--prefill-workers", "1", "--model", model, "--draft", "self:4"])
    prefill = math.ceil(_llama3_8b_prefill_bytes(16384, 2) / 80 / 2**30 * 1e4) / 1e4
    assert got["draft"] == (0.3, "")
    assert got["prefill"][0] == prefill
    assert got["decode"][0] == pytest.approx(0.9 - 0.3 - prefill, abs=1e-4)


@pytest.mark.parametrize(
    ("device_gib", "model", "reason"),
    [
        # On a 16 GiB device a Llama-3-8B prefill worker needs more than an equal part.
        (16, "llama", "an equal part: a prefill worker needs"),
        # The device's memory cannot be read (no CUDA driver).
        (None, "llama", "an equal part: the memory of cuda:0 could not be read"),
        # The model's config cannot be read.
        (80, "missing", "an equal part: what a prefill worker needs could not be found"),
    ],
)
def test_up_splits_a_shared_gpu_equally_where_a_prefill_need_does_not_fit(
    device_gib, model, reason, gpu_host, tmp_path
):
    gpu_host(device_gib)
    path = _llama3_8b(tmp_path) if model == "llama" else str(tmp_path)
    got = _shares(["--prefill-workers", "1", "--model", path])
    assert {name: share for name, (share, _) in got.items()} == {"prefill": 0.45, "decode": 0.45}
    assert got["prefill"][1].startswith(reason)
    assert got["decode"][1] == ""


def test_up_reads_a_gpu_memory_as_torch_does():
    import torch

    got = up_module._gpu_total_memory("cuda")
    if torch.cuda.is_available():
        assert got == torch.cuda.get_device_properties(0).total_memory
    else:
        assert got is None or up_module._cuda_driver() is not None
