"""What this machine is, as the kernels ONNX Runtime picks see it: the CPU's model and instruction sets.

:func:`machine_id` keys the step plan's verdicts (:mod:`.verdicts`); :func:`cpu_name` and :func:`cpu_isa`
are printed beside figures.
"""

from __future__ import annotations

import functools
import hashlib
import platform

ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "amx_bf16", "asimddp", "sve")
# /proc/cpuinfo names of the flags numpy also detects, by CPUID, in this very process
_NUMPY_NAMES = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512_vnni": "AVX512VNNI", "avx512_bf16": "AVX512BF16",
                "asimddp": "ASIMDDP", "sve": "SVE"}


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of ``/proc/cpuinfo`` (empty where it is not readable), read once."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (``/proc/cpuinfo``; empty where it is not readable)."""
    info = _cpuinfo()
    return frozenset(info.get("flags", info.get("Features", "")).split())


def process_features() -> frozenset[str] | None:
    """The instruction sets this process's CPUID reports, as numpy detected them at import; None if unknown.

    Usually what /proc/cpuinfo says; not under an emulator (``qemu-x86_64 -cpu EPYC-Rome``, whose guest
    sees AVX2 only while /proc/cpuinfo shows the host's AVX-512) or a hypervisor that masks features.
    ONNX Runtime picks its kernels by CPUID, so this is the view that decides them."""
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as feats  # numpy >= 2
    except ImportError:
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as feats  # numpy 1.x
        except ImportError:
            return None
    return frozenset(k for k, on in feats.items() if on)


def cpu_isa() -> str:
    """The kernel-relevant instruction sets, e.g. ``avx2`` or ``avx2 avx512f avx512_vnni``, to print beside figures.

    Flags /proc/cpuinfo lists but this process's CPUID lacks are left out; where the two views disagree,
    the flags numpy cannot check (AVX-VNNI, AMX) are left out too and the text says so."""
    flags, seen = cpu_flags(), process_features()
    if seen is None or not flags:
        return " ".join(f for f in ISA_FLAGS if f in flags) or "unknown"
    masked = {f for f, name in _NUMPY_NAMES.items() if f in flags and name not in seen}
    keep = [f for f in ISA_FLAGS if f in flags and f not in masked and (f in _NUMPY_NAMES or not masked)]
    note = f" (CPUID lacks {' '.join(sorted(masked))} of /proc/cpuinfo: emulated or masked)" if masked else ""
    return (" ".join(keep) or "unknown") + note


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers, to print beside figures: a hypervisor often names
    different CPUs alike (``Intel(R) Xeon(R) Processor, family 6 model 167``)."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    if "cpu family" in info and "model" in info:
        name += f", family {info['cpu family']} model {info['model']}"
    return name


def machine_id() -> str:
    """The CPU model (its family and model numbers too) and instruction-set flags, which decide the kernels ONNX
    Runtime picks."""
    model = cpu_name()
    seen = process_features()
    flags = " ".join(sorted(cpu_flags())) + " | cpuid: " + (" ".join(sorted(seen)) if seen is not None else "?")
    return f"{model} | {platform.machine()} | {cpu_isa()} | {hashlib.sha1(flags.encode()).hexdigest()[:12]}"


__all__ = ["ISA_FLAGS", "cpu_flags", "cpu_isa", "cpu_name", "machine_id", "process_features"]
