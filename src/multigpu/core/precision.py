"""Mixed precision as one object: it owns autocast and the GradScaler, and its state is checkpointed.

- `fp32`: nothing to do.
- `bf16`: autocast to bfloat16; same exponent range as fp32, so no loss scaling.
- `fp16`: autocast to float16 plus a GradScaler. The scaler multiplies the loss so small
  gradients survive fp16, unscales before clipping, skips the optimizer step when a gradient is
  inf/NaN and lowers the scale (trap 7: it must step and update every iteration, which
  `optimizer_step` guarantees).
"""
from __future__ import annotations

import contextlib

import torch

from multigpu.core.errors import Api, Text, UsageError
from multigpu.core.precision_config import PRECISIONS
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(kind: str, device: torch.device) -> str:
    """"auto" is bf16 where the device computes it fast (CUDA GPUs that support it), else fp32."""
    if kind != "auto":
        return kind
    if device.type == "cuda" and _bf16_native():
        return "bf16"
    return "fp32"


def _bf16_native() -> bool:
    """bf16 in hardware (Ampere and newer), not emulated (V100, T4: slower than fp32)."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch without the argument
        return torch.cuda.is_bf16_supported()


class Precision:
    """Mixed precision for one device: autocast, the fp16 GradScaler, and their checkpoint state.

    kind:   "fp32", "bf16" or "fp16" ("auto" is resolved by setup() before it gets here).
    device: the device the model computes on; bf16 on a GPU without it raises UsageError.

    `setup()` makes one, as `rt.precision`; the Runtime's `autocast()`, `backward()` and
    `step()` call it. Used alone, one iteration is:

        precision = Precision("fp16", torch.device("cuda", 0))
        with precision.autocast():
            loss = loss_fn(model(x), y)
        precision.backward(loss)          # scaled for fp16
        precision.unscale(optimizer)      # only before clipping or reading gradients
        precision.optimizer_step(optimizer)
        optimizer.zero_grad()
    """

    def __init__(self, kind: str, device: torch.device):
        if kind not in PRECISIONS:
            raise UsageError(f"unknown precision {kind!r}: choose one of {', '.join(PRECISIONS)}")
        if kind == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise UsageError(Text(f"GPU {torch.cuda.get_device_name(device)} has no bf16; use {{}} "
                                  "(or fp32)", Api("setup.precision", "fp16")))
        self.kind = kind
        self.device = device
        self.scaler = torch.amp.GradScaler(device.type) if kind == "fp16" else None
        # Steps skipped by the scaler, counted on the device so the step never waits for the GPU.
        self._skipped = torch.zeros((), dtype=torch.int64, device=device) if self.scaler else None
        self._update_pending = False

    @property
    def dtype(self) -> torch.dtype:
        """The autocast dtype: torch.bfloat16, torch.float16, or torch.float32 for fp32."""
        return _DTYPES.get(self.kind, torch.float32)

    def autocast(self):
        """A context manager for the forward pass: torch.autocast to `dtype`, a no-op for fp32."""
        if self.kind == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """`loss.backward()`, with the loss scaled first for fp16."""
        if self.scaler is not None:
            self._update_scale()
            loss = self.scaler.scale(loss)
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true size; call before clipping or inspecting them."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """`optimizer.step()`; for fp16 through the scaler, which skips the step when a gradient
        is inf/NaN and lowers the scale (updated before the next backward)."""
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skipped inside if any of its gradients is inf/NaN
        # The scale is updated once per iteration, before the next backward: every optimizer
        # stepped from this loss (several, say) must be unscaled with the same scale.
        self._update_pending = True

    def _update_scale(self) -> None:
        if not self._update_pending:
            return
        self._update_pending = False
        before = self.scaler._scale.clone()
        self.scaler.update()
        self._skipped += (self.scaler._scale < before).to(torch.int64)  # it only drops on a skip

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped for inf/NaN gradients so far (a host-device sync point)."""
        if self._skipped is None:
            return 0
        self._update_scale()
        return int(self._skipped.item())

    def state_dict(self) -> dict:
        """{"kind": ..., "scaler": the GradScaler's state or None}, saved in checkpoints."""
        if self.scaler is not None:
            self._update_scale()
        return {"kind": self.kind, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict) -> None:
        """Restore the GradScaler's scale from `state_dict()`'s output (nothing to do otherwise)."""
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
