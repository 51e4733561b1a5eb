"""The stage credentials and the API key come from a file or the environment, never from argv;
each process gets the credentials of its role."""

from __future__ import annotations

import pytest

from tandem.rpc.auth import stage_credentials_from_args
from tandem.stage_args import (
    gateway_config_from_args,
    stage_parser,
    stage_secret_from_args,
)
from tandem.up import Secrets, _stage_env


@pytest.mark.parametrize("stage", ["gateway", "prefill", "decode", "draft"])
def test_no_flag_takes_the_secret_itself(stage, capsys):
    extra = ["--prefill", "p:1", "--decode", "d:1"] if stage == "gateway" else []
    with pytest.raises(SystemExit):
        stage_parser(stage).parse_args([*extra, "--stage-secret", "s"])
    assert "--stage-secret is not accepted" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        stage_parser(stage).parse_args([*extra, "--gateway-secret", "s"])
    assert "--gateway-secret is not accepted" in capsys.readouterr().err


def test_secret_from_env_or_file(tmp_path, monkeypatch):
    p = stage_parser("prefill")
    monkeypatch.delenv("TANDEM_STAGE_SECRET", raising=False)
    monkeypatch.delenv("TANDEM_STAGE_SECRET_FILE", raising=False)
    assert stage_secret_from_args(p.parse_args([])) is None
    monkeypatch.setenv("TANDEM_STAGE_SECRET", "from-env")
    assert stage_secret_from_args(p.parse_args([])) == b"from-env"
    f = tmp_path / "secret"
    f.write_text("from-file\n")
    with pytest.raises(ValueError, match="once"):
        stage_secret_from_args(p.parse_args(["--stage-secret-file", str(f)]))
    monkeypatch.delenv("TANDEM_STAGE_SECRET")
    assert stage_secret_from_args(p.parse_args(["--stage-secret-file", str(f)])) == b"from-file"
    monkeypatch.setenv("TANDEM_STAGE_SECRET_FILE", str(f))
    assert stage_secret_from_args(p.parse_args([])) == b"from-file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        stage_secret_from_args(p.parse_args(["--stage-secret-file", str(tmp_path / "empty")]))
    with pytest.raises(ValueError, match="cannot be read"):
        stage_secret_from_args(p.parse_args(["--stage-secret-file", str(tmp_path / "nope")]))


def test_api_key_from_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    f = tmp_path / "key"
    f.write_text("k3y\n")
    p = stage_parser("gateway")
    base = ["--prefill", "p:1", "--decode", "d:1"]
    assert (
        gateway_config_from_args(p.parse_args([*base, "--api-key-file", str(f)])).api_key == "k3y"
    )
    with pytest.raises(ValueError, match="once"):
        gateway_config_from_args(
            p.parse_args([*base, "--api-key-file", str(f), "--api-key", "other"])
        )


@pytest.mark.parametrize("how", ["flag", "env"])
@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_api_key_is_refused(how, value, monkeypatch):
    # An empty key must not silently turn authentication off.
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    argv = ["--prefill", "p:1", "--decode", "d:1"]
    if how == "flag":
        argv += ["--api-key", value]
    else:
        monkeypatch.setenv("TANDEM_API_KEY", value)
    with pytest.raises(ValueError, match="set but empty"):
        gateway_config_from_args(stage_parser("gateway").parse_args(argv))


@pytest.mark.parametrize("var", ["TANDEM_API_KEY_FILE", "TANDEM_API_KEYS"])
def test_an_empty_api_key_file_variable_is_refused(var, monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.setenv(var, "")
    args = stage_parser("gateway").parse_args(["--prefill", "p:1", "--decode", "d:1"])
    with pytest.raises(ValueError, match=f"{var} is set but empty"):
        gateway_config_from_args(args)


@pytest.mark.parametrize("var", ["TANDEM_STAGE_SECRET", "TANDEM_STAGE_SECRET_FILE"])
def test_an_empty_stage_secret_variable_is_refused(var, monkeypatch):
    # A secret from an empty Kubernetes Secret or an unset shell variable must not leave the
    # stage ports open.
    monkeypatch.delenv("TANDEM_STAGE_SECRET", raising=False)
    monkeypatch.delenv("TANDEM_STAGE_SECRET_FILE", raising=False)
    monkeypatch.setenv(var, "")
    with pytest.raises(ValueError, match=f"{var} is set but empty"):
        stage_secret_from_args(stage_parser("prefill").parse_args([]))


def _clear_credentials(monkeypatch) -> None:
    for var in ("STAGE_SECRET", "STAGE_SECRET_FILE", "GATEWAY_SECRET", "GATEWAY_SECRET_FILE"):
        monkeypatch.delenv(f"TANDEM_{var}", raising=False)


def test_credentials_by_role(monkeypatch):
    _clear_credentials(monkeypatch)
    monkeypatch.setenv("TANDEM_STAGE_SECRET", "workers")
    monkeypatch.setenv("TANDEM_GATEWAY_SECRET", "gateway")
    worker = stage_credentials_from_args(stage_parser("prefill").parse_args([]), "prefill")
    assert (worker.secret, worker.gateway_secret, worker.sent) == (
        b"workers",
        b"gateway",
        b"workers",
    )
    # The gateway, facing the internet, must not hold the workers' secret.
    gw_args = stage_parser("gateway").parse_args(["--prefill", "p:1", "--decode", "d:1"])
    with pytest.raises(
        ValueError, match="the gateway takes no stage secret.*TANDEM_GATEWAY_SECRET"
    ):
        stage_credentials_from_args(gw_args, "gateway")
    monkeypatch.delenv("TANDEM_STAGE_SECRET")
    gateway = stage_credentials_from_args(gw_args, "gateway")
    assert (gateway.secret, gateway.sent) == (None, b"gateway")
    # A worker given only the gateway's secret would leave its port open to everything else.
    with pytest.raises(ValueError, match="only by a worker that has a stage secret"):
        stage_credentials_from_args(stage_parser("decode").parse_args([]), "decode")
    monkeypatch.setenv("TANDEM_STAGE_SECRET", "gateway")
    with pytest.raises(ValueError, match="must differ from the stage secret"):
        stage_credentials_from_args(stage_parser("draft").parse_args([]), "draft")


def test_tandem_up_gives_the_gateway_no_stage_secret(monkeypatch):
    _clear_credentials(monkeypatch)
    monkeypatch.setenv("TANDEM_STAGE_SECRET_FILE", "/run/stage-secret")
    creds = Secrets(stage="workers", gateway="gateway")
    gateway = {**_stage_env("gateway"), **creds.env("gateway")}
    assert gateway["TANDEM_GATEWAY_SECRET"] == "gateway"
    assert "TANDEM_STAGE_SECRET" not in gateway and "TANDEM_STAGE_SECRET_FILE" not in gateway
    decode = {**_stage_env("decode"), **creds.env("decode")}
    assert decode["TANDEM_STAGE_SECRET"] == "workers"
    assert decode["TANDEM_GATEWAY_SECRET"] == "gateway"
    assert "TANDEM_STAGE_SECRET_FILE" not in decode  # passed by value, once
