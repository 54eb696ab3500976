"""``bench --emulate-cpu``: our variants' workers under QEMU user-mode emulation of another CPU model.

ONNX Runtime picks its CPU kernels by the instruction sets CPUID reports, so whether a bundle's
speculative rows are bitwise its plain rows depends on the CPU kind (an AVX2-only EPYC differs from an
AVX-512 one). ``qemu-x86_64 -cpu EPYC-Rome`` runs the same Python, ONNX Runtime and bundle with the
CPUID of an AVX2-only CPU, in software floating point that rounds as the hardware does, so the step
plan the probe chooses there and the identity of every variant with ``ar`` are what such a CPU gives.
Its tokens per second are the emulator's, not a CPU's: the report says so and compares nothing by speed.
Peers run natively only (their builds may use instructions the emulated CPU lacks).
"""

from __future__ import annotations

import functools
import platform
import shutil
import subprocess
import sys

from specdeploy.exporter.bench.spec import BenchError

QEMU = {"x86_64": "qemu-x86_64", "aarch64": "qemu-aarch64"}
_TIMEOUT_S = 120


@functools.cache
def emulator(cpu: str) -> tuple[str, ...]:
    """The command prefix that runs a program on the emulated ``cpu`` model; BenchError if there is none."""
    exe = shutil.which(QEMU.get(platform.machine(), "qemu-" + platform.machine()))
    if exe is None:
        raise BenchError(f"--emulate-cpu needs QEMU user-mode emulation ({QEMU.get(platform.machine(), 'qemu-user')}, "
                         f"Debian/Ubuntu package qemu-user), which is not installed.")
    listing = subprocess.run([exe, "-cpu", "help"], check=False, capture_output=True, text=True, timeout=_TIMEOUT_S).stdout
    models = {word for parts in map(str.split, listing.splitlines()) for word in parts[:2]}  # 'x86 EPYC-Rome ...', 'cortex-a72'
    if cpu not in models:
        raise BenchError(f"QEMU knows no CPU model '{cpu}'; '{exe} -cpu help' lists them (EPYC-Rome is an "
                         f"AVX2-only AMD EPYC, Haswell an AVX2-only Intel).")
    return (exe, "-cpu", cpu)


def emulated_machine(cpu: str) -> dict[str, str]:
    """What the report says of the emulated CPU: the model, QEMU's version and the ISA its guest sees."""
    prefix = list(emulator(cpu))
    version = subprocess.run([prefix[0], "--version"], check=False, capture_output=True, text=True, timeout=_TIMEOUT_S)
    probe = subprocess.run([*prefix, sys.executable, "-c", "from specdeploy.runtime.machine import cpu_isa; print(cpu_isa())"],
                           check=False, capture_output=True, text=True, timeout=_TIMEOUT_S)
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"Python does not start under '{' '.join(prefix)}': {tail}")
    first = (version.stdout.splitlines() or ["qemu"])[0]
    return {"cpu_model": f"{cpu} (emulated: {first})", "cpu_isa": probe.stdout.strip().splitlines()[-1]}


def emulation_note(cpu: str) -> str:
    return (f"EMULATED CPU {cpu} under QEMU: tok/s are the emulator's, not a CPU's; what this run measures is "
            f"the step plan chosen on that CPU kind and identity with ar.")
