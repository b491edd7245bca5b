"""The CPU at hand: its model name and instruction-set flags, read from ``/proc/cpuinfo``."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NATIVE_DTYPE_FLAGS", "CpuInfo"]

NATIVE_DTYPE_FLAGS = {
    "bfloat16": ("avx512_bf16", "amx_bf16", "bf16", "sve_bf16"),
    "float16": ("avx512_fp16", "amx_fp16", "fphp"),
}
"""CPU flags (x86 and Arm, as /proc/cpuinfo spells them) that mean a dtype's products run natively."""


@dataclass(frozen=True)
class CpuInfo:
    """What identifies a CPU: its model name and instruction-set flags (for tuning, for build folders, for a
    plugin choosing its kernels)."""

    model_name: str
    flags: frozenset[str]

    @classmethod
    def read(cls, cpuinfo: Path = Path("/proc/cpuinfo")) -> CpuInfo:
        """This machine's CPU, from ``/proc/cpuinfo`` where there is one (x86 and Arm spell the fields apart)."""
        fields: dict[str, str] = {}
        try:
            for line in cpuinfo.read_text().splitlines():
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
        except OSError:
            pass
        name = fields.get("model name") or fields.get("cpu model") or platform.processor() or platform.machine()
        return cls(name, frozenset((fields.get("flags") or fields.get("Features") or "").split()))

    def native_dtypes(self) -> tuple[str, ...]:
        """Dtypes whose products this CPU computes natively, float32 first."""
        return ("float32", *(dtype for dtype, needed in NATIVE_DTYPE_FLAGS.items() if self.flags & set(needed)))
