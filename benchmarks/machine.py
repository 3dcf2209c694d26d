"""The machine a benchmark ran on: CPU model and family, the flags our kernels dispatch on, and its measured limits
(memory read bandwidth, GEMM peak). Every result table names it, because numbers from different CPU classes
(Zen 4, Zen 5, Xeon with AMX) are not comparable (../shared/bench/README.md)."""
from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


@dataclass
class Machine:
    cpu: str
    family: str
    model: str
    flags: list[str]
    cores: int
    threads: int
    load: tuple[float, float, float]

    def line(self) -> str:
        return (f"{self.cpu} (cpu family {self.family}, model {self.model}; {' '.join(self.flags) or 'no AVX-512'}), "
                f"{self.cores} cores, {self.threads} torch threads, torch {torch.__version__}, load average "
                f"{self.load[0]:.2f} at start")


@dataclass
class Limits:
    read_gbs: float  # x.sum() over 1 GiB
    fp32_gflops: float  # torch.mm 2048^3
    bf16_gflops: float

    def line(self) -> str:
        return (f"measured limits: memory read {self.read_gbs:.0f} GB/s, fp32 GEMM {self.fp32_gflops:.0f} GFLOP/s, "
                f"bf16 GEMM {self.bf16_gflops:.0f} GFLOP/s")


def describe() -> Machine:
    fields: dict[str, str] = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line.strip():
            break  # the first processor is enough
    flags = fields.get("flags", "").split()
    return Machine(cpu=fields.get("model name", platform.processor() or platform.machine()),
                   family=fields.get("cpu family", "?"), model=fields.get("model", "?"),
                   flags=[f for f in _FLAGS_OF_INTEREST if f in flags], cores=os.cpu_count() or 0,
                   threads=torch.get_num_threads(), load=os.getloadavg())


def best_seconds(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after a warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth_gbs() -> float:
    x = torch.ones(1 << 28)  # 1 GiB of fp32
    return x.numel() * 4 / best_seconds(x.sum, 5) / 1e9


def measure_limits() -> Limits:
    read = read_bandwidth_gbs()
    n = 2048
    gflops = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        gflops[dtype] = 2 * n ** 3 / best_seconds(lambda: torch.mm(a, b), 3) / 1e9
    return Limits(read, gflops[torch.float32], gflops[torch.bfloat16])
