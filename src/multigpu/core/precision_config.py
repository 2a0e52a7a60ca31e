"""The precision a run asks for, as one checked value (precision.py, which needs torch, does the
work). "auto" is resolved per device by precision.resolve_precision."""
from __future__ import annotations

from dataclasses import dataclass

from multigpu.core.options import check_options, option

PRECISIONS = ("fp32", "bf16", "fp16")  # plus "auto", resolved by precision.resolve_precision()


@dataclass(frozen=True)
class PrecisionConfig:
    precision: str = option("auto", "fp32 | bf16 | fp16 (with loss scaling) | auto (bf16 on GPUs "
                                    "that support it, else fp32; fp32 for lstm and tst)",
                            choices=("auto", *PRECISIONS))

    def __post_init__(self):
        check_options(self)
