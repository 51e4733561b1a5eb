"""Kernel settings: one typed declaration, one boolean parser, read by the kernels from config."""

from __future__ import annotations

from dataclasses import fields

import pytest

from tandem import config
from tandem.config import EngineConfig, KernelConfig
from tandem.config_kernels import ENGINE_FIELDS


def test_defaults_and_environment(monkeypatch) -> None:
    for name in ("TANDEM_PREFILL_ATTENTION", "TANDEM_DETERMINISTIC", "TANDEM_PDL"):
        monkeypatch.delenv(name, raising=False)
    cfg = KernelConfig.from_env()
    assert (cfg.prefill_attention, cfg.deterministic, cfg.pdl) == ("auto", False, True)
    monkeypatch.setenv("TANDEM_PREFILL_ATTENTION", "sdpa")
    monkeypatch.setenv("TANDEM_DETERMINISTIC", "yes")
    monkeypatch.setenv("TANDEM_PDL", "off")
    cfg = KernelConfig.from_env()
    assert (cfg.prefill_attention, cfg.deterministic, cfg.pdl) == ("sdpa", True, False)
    # The engine's options read the same variables, through the same parser.
    assert EngineConfig.from_options().kernel_config() == cfg
    assert EngineConfig.from_options(pdl=True).kernel_config().pdl is True


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_true_spellings(monkeypatch, value: str) -> None:
    monkeypatch.setenv("TANDEM_DETERMINISTIC", value)
    assert KernelConfig.from_env().deterministic is True


@pytest.mark.parametrize("value", ["0", "False", "no", "off"])
def test_false_spellings(monkeypatch, value: str) -> None:
    monkeypatch.setenv("TANDEM_PDL", value)
    assert KernelConfig.from_env().pdl is False


@pytest.mark.parametrize("name", ["TANDEM_PDL", "TANDEM_DETERMINISTIC"])
def test_bad_boolean_names_the_variable(monkeypatch, name: str) -> None:
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=f"{name}='maybe' is not a boolean"):
        KernelConfig.from_env()
    with pytest.raises(ValueError, match=f"{name}='maybe' is not a boolean"):
        EngineConfig.from_options()


def test_bad_prefill_attention_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_PREFILL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="prefill_attention must be one of auto, sdpa, triton"):
        KernelConfig.from_env()
    monkeypatch.delenv("TANDEM_PREFILL_ATTENTION")
    with pytest.raises(ValueError, match="got 'flash'"):
        EngineConfig.from_options(prefill_attention="flash")
    with pytest.raises(ValueError, match="prefill_attention"):
        config.set_kernel_config(KernelConfig(prefill_attention="flash"))


def test_process_settings_are_installed_and_restored() -> None:
    mine = KernelConfig(deterministic=True, pdl=False)
    old = config.set_kernel_config(mine)
    try:
        assert config.kernel_config() is mine
        import torch

        from tandem.kernels import pdl, w4a16

        assert not w4a16.gemv_atomic_enabled(torch.bfloat16)  # deterministic
        assert not pdl.use_pdl(torch.zeros(1))
    finally:
        config.set_kernel_config(old)


def test_engine_installs_its_kernel_settings() -> None:
    import tandem

    llm = tandem.LLM(num_blocks=16, max_model_len=64, deterministic=True, pdl=False)
    assert config.kernel_config() == llm.engine.config.kernel_config()
    assert config.kernel_config().deterministic and not config.kernel_config().pdl
    assert llm.engine.model.kernels is config.kernel_config()


def test_engine_declares_the_kernel_variables() -> None:
    # KernelConfig.from_env reads the variables of these EngineConfig fields by its own types.
    engine = {f.name: str(f.type) for f in fields(EngineConfig)}
    kernel = {f.name: str(f.type) for f in fields(KernelConfig)}
    assert {n: kernel[n] for n in ENGINE_FIELDS} == {n: engine[n] for n in ENGINE_FIELDS}
