"""The autocast precision a job runs in, chosen by what its device does fast, and the reason recorded with it.

``precision: auto`` resolves per device:

* CUDA: bf16 where the GPU supports it, else fp16 (with a GradScaler).
* CPU: bf16 only where this CPU has native bf16 matmuls, as torch reports them (AMX tiles or AVX512-BF16
  on x86, with torch dispatching AVX512 kernels); fp32 on every other x86 CPU, where torch emulates bf16
  matmuls (measured 70x slower than fp32 on an AVX2-only AMD EPYC). On other architectures (ARM, POWER)
  torch reports no such flag, so a short matmul probe, measured once per process, decides: bf16 where it
  is not slower than fp32.

An explicit ``bf16`` on a CPU without native bf16 still runs, with a one-line warning naming the slowdown the
probe measured. :func:`choose_precision` returns the precision with its reason, which every pretraining
summary, fine-tuning result and first log line records.
"""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass
from functools import lru_cache

import torch

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
X86 = ("x86_64", "amd64", "i386", "i686", "x86")
PROBE_SIZE = 128  # a 128 x 128 matmul: ~20 ms in emulated bf16, ~1 ms in fp32 on one AVX2 core


@dataclass(frozen=True)
class Precision:
    """The autocast dtype a job runs in (``bf16``, ``fp16`` or ``fp32``) and why it was chosen."""

    name: str
    reason: str


def cpu_capability() -> str:
    """torch's name for the vector instructions it dispatches to on this CPU (``AVX2``, ``AVX512``, ...)."""
    return torch.backends.cpu.get_cpu_capability()


def cpu_bf16_flags() -> list[str]:
    """The bf16 features torch reports on this CPU: ``AMX`` and/or ``AVX512-BF16`` (x86 only)."""
    flags = []
    if torch.cpu._is_amx_tile_supported():
        flags.append("AMX")
    if torch.cpu._is_avx512_bf16_supported():
        flags.append("AVX512-BF16")
    return flags


def _best_time(dtype: torch.dtype, reps: int = 3) -> float:
    a = torch.randn(PROBE_SIZE, PROBE_SIZE).to(dtype)
    b = torch.randn(PROBE_SIZE, PROBE_SIZE).to(dtype)
    torch.matmul(a, b)  # warm-up: kernel selection, allocation
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return best


@lru_cache(maxsize=1)
def bf16_slowdown() -> float:
    """Time of a bf16 matmul over the same fp32 matmul on this CPU (best of 3 each), measured once per process."""
    return _best_time(torch.bfloat16) / max(_best_time(torch.float32), 1e-9)


def native_bf16_flags() -> list[str]:
    """:func:`cpu_bf16_flags` where torch dispatches AVX512 kernels, else none (``ATEN_CPU_CAPABILITY=avx2``
    caps the dispatch, as ``ONEDNN_MAX_CPU_ISA=AVX2`` caps oneDNN's: the CPU then runs bf16 emulated)."""
    return cpu_bf16_flags() if cpu_capability().startswith("AVX512") else []


@lru_cache(maxsize=1)
def cpu_bf16() -> tuple[bool, str]:
    """Whether this CPU runs bf16 natively, and what says so."""
    capability = cpu_capability()
    flags = native_bf16_flags()
    if flags:
        return True, f"CPU {capability} with native bf16 ({', '.join(flags)})"
    if platform.machine().lower() in X86:
        return False, f"CPU {capability} without native bf16 (no AMX or AVX512-BF16)"
    ratio = bf16_slowdown()
    verdict = "not slower" if ratio <= 1.0 else "slower"
    return ratio <= 1.0, f"CPU {capability} ({platform.machine()}): bf16 matmul {ratio:.2f}x fp32's time, {verdict}"


@lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def choose_precision(name: str, device: torch.device) -> Precision:
    """Resolve ``name`` (one of :data:`PRECISIONS`) for ``device``; see the module docstring."""
    if name not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {name!r}")
    if device.type == "cuda":
        if name != "auto":
            return Precision(name, "set in the config")
        if torch.cuda.is_bf16_supported():
            return Precision("bf16", "auto: the GPU supports bf16")
        return Precision("fp16", "auto: the GPU has no bf16 (fp16 with a GradScaler)")
    if name == "fp16":
        raise ValueError("precision fp16 needs a CUDA device; use auto, bf16 or fp32 on a CPU")
    native, why = cpu_bf16()
    if name == "auto":
        return Precision("bf16" if native else "fp32", f"auto: {why}")
    if name == "bf16" and not native:
        _warn_once(
            f"warning: precision bf16 on a {why}: a bf16 matmul measured {bf16_slowdown():.0f}x slower than fp32 "
            "here; precision: auto picks fp32 on this CPU"
        )
    return Precision(name, "set in the config")


def resolve_precision(name: str, device: torch.device) -> str:
    """The name of :func:`choose_precision`'s choice."""
    return choose_precision(name, device).name


def autocast(precision: str, device: torch.device):
    """The autocast context of a resolved precision (``fp32`` disables autocast)."""
    if precision == "fp32":
        return torch.autocast(device.type, enabled=False)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if dtype == torch.float16 and device.type != "cuda":
        raise ValueError("precision fp16 needs a CUDA device; use bf16 or fp32 on CPU")
    return torch.autocast(device.type, dtype=dtype)
