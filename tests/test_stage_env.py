"""Stage flags whose defaults come from TANDEM_* variables check those values as they check
the flags: a wrong value stops the stage with a message naming the variable."""

from __future__ import annotations

import pytest

from tandem.stage_args import stage_parser


def test_variables_give_the_defaults(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_MAX_LEASES_PER_PEER", "7")
    monkeypatch.setenv("TANDEM_KV_TRANSPORT", "shm")
    assert stage_parser("prefill").parse_args([]).max_leases_per_peer == 7
    assert stage_parser("decode").parse_args([]).kv_transport == "shm"
    # The flag still wins over the variable.
    assert stage_parser("decode").parse_args(["--kv-transport", "inline"]).kv_transport == "inline"


def test_an_empty_variable_is_unset(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_MAX_LEASES_PER_PEER", " ")
    monkeypatch.setenv("TANDEM_KV_TRANSPORT", "")
    assert stage_parser("prefill").parse_args([]).max_leases_per_peer == 1024
    assert stage_parser("decode").parse_args([]).kv_transport == "auto"


@pytest.mark.parametrize(
    ("stage", "var", "value", "words"),
    [
        ("prefill", "TANDEM_MAX_LEASES_PER_PEER", "many", "not a valid int"),
        ("decode", "TANDEM_KV_TRANSPORT", "carrier-pigeon", "choose one of auto, cuda_ipc"),
    ],
)
def test_a_wrong_value_names_its_variable(monkeypatch, stage, var, value, words) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(SystemExit) as e:
        stage_parser(stage)
    assert var in str(e.value) and repr(value) in str(e.value) and words in str(e.value)
