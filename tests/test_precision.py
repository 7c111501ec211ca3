"""``precision: auto`` by what the CPU does fast: bf16 where it is native, fp32 elsewhere (the probe and the
capability flags stubbed, so both branches run on any CPU)."""

import pytest
import torch

from cramswarm import precision as prec

CPU = torch.device("cpu")


@pytest.fixture
def cpu(monkeypatch):
    """Stub what the CPU reports: ``cpu(flags, machine, slowdown)``; clears the per-process caches."""

    def stub(flags=(), machine="x86_64", slowdown=70.0, capability="AVX2"):
        monkeypatch.setattr(prec, "cpu_bf16_flags", lambda: list(flags))
        monkeypatch.setattr(prec, "cpu_capability", lambda: capability)
        monkeypatch.setattr(prec.platform, "machine", lambda: machine)
        monkeypatch.setattr(prec, "_best_time", lambda dtype: slowdown if dtype == torch.bfloat16 else 1.0)
        for cached in (prec.cpu_bf16, prec.bf16_slowdown, prec._warn_once):
            cached.cache_clear()

    yield stub
    for cached in (prec.cpu_bf16, prec.bf16_slowdown, prec._warn_once):
        cached.cache_clear()


@pytest.mark.parametrize("flags", [["AMX"], ["AVX512-BF16"], ["AMX", "AVX512-BF16"]])
def test_auto_is_bf16_on_a_cpu_with_native_bf16(cpu, flags):
    cpu(flags=flags, capability="AVX512")
    chosen = prec.choose_precision("auto", CPU)
    assert chosen.name == "bf16"
    assert chosen.reason.startswith("auto: CPU AVX512 with native bf16") and flags[0] in chosen.reason


def test_auto_is_fp32_on_an_x86_cpu_without_native_bf16(cpu):
    cpu(flags=[], machine="x86_64", slowdown=0.5)  # the probe is not asked on x86: the flags decide
    chosen = prec.choose_precision("auto", CPU)
    assert chosen == prec.Precision("fp32", "auto: CPU AVX2 without native bf16 (no AMX or AVX512-BF16)")
    cpu(flags=["AVX512-BF16"], capability="AVX2")  # torch capped below AVX512 (ATEN_CPU_CAPABILITY=avx2)
    assert prec.choose_precision("auto", CPU).name == "fp32"


@pytest.mark.parametrize("slowdown, expected", [(0.6, "bf16"), (1.0, "bf16"), (3.0, "fp32")])
def test_auto_asks_the_probe_on_other_architectures(cpu, slowdown, expected):
    cpu(flags=[], machine="aarch64", slowdown=slowdown, capability="DEFAULT")
    chosen = prec.choose_precision("auto", CPU)
    assert chosen.name == expected
    assert f"bf16 matmul {slowdown:.2f}x fp32's time" in chosen.reason


def test_explicit_bf16_without_native_bf16_runs_with_one_warning_line(cpu, capsys):
    cpu(flags=[], slowdown=70.0)
    assert prec.choose_precision("bf16", CPU) == prec.Precision("bf16", "set in the config")
    prec.choose_precision("bf16", CPU)  # warned once per process
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "measured 70x slower than fp32" in err and "auto picks fp32" in err


def test_explicit_bf16_on_native_bf16_and_fp32_anywhere_say_nothing(cpu, capsys):
    cpu(flags=["AMX"], capability="AVX512")
    assert prec.resolve_precision("bf16", CPU) == "bf16"
    cpu(flags=[])
    assert prec.resolve_precision("fp32", CPU) == "fp32"
    assert capsys.readouterr().err == ""


def test_fp16_and_unknown_names_are_refused_on_cpu():
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        prec.choose_precision("fp16", CPU)
    with pytest.raises(ValueError, match="precision must be one of"):
        prec.choose_precision("tf32", CPU)


def test_the_real_probe_measures_this_cpu():
    """Unstubbed: the probe times real matmuls and the flags come from torch (whatever this CPU is)."""
    prec.bf16_slowdown.cache_clear()
    assert prec.bf16_slowdown() > 0
    native, why = prec.cpu_bf16()
    if prec.platform.machine().lower() in prec.X86:
        assert native == bool(prec.native_bf16_flags())
    assert prec.cpu_capability() in why
