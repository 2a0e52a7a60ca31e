"""NVML's view of a launch's GPUs for device_health (nvidia-ml-py's documented calls only).

Made when the launch starts: NVML initialised for the launch, each GPU's uncorrected volatile ECC
count taken as the baseline, and an event set registered for critical Xids. Asked after a rank
died, a GPU is unhealthy when NVML cannot get its handle (the GPU lost, or not found), a hardware
Xid (XID_HARDWARE) was reported for it since the start, its uncorrected ECC count
grew, retired pages are pending, or row remapping failed. Anything NVML cannot say (not
supported, another error) is no finding: unknown is healthy.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence

# Xids NVIDIA's guide ties to the hardware, not to the program (13, 31, 43: a program's own fault)
XID_HARDWARE = frozenset({48, 61, 62, 63, 64, 69, 74, 79, 92, 94, 95, 119, 120, 140})


class NvmlHealth:
    def __init__(self, gpus: Sequence):
        self.nv = self.events = None
        self.ecc: dict[str, int] = {}
        self.xids: dict[str, list[int]] = {}
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # no driver, no library: nothing to ask
            return
        self.nv = pynvml
        with contextlib.suppress(pynvml.NVMLError):
            self.events = pynvml.nvmlEventSetCreate()
        for d in gpus:
            self.ecc[d.name] = self._ecc(d) or 0
            if self.events is not None and (h := self._handle(d)) is not None:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self.events)

    def _handle(self, d):
        token = d.token or d.index
        if token.startswith(("GPU-", "MIG-")):
            return self.nv.nvmlDeviceGetHandleByUUID(token)
        return self.nv.nvmlDeviceGetHandleByIndex(int(token)) if token.isdigit() else None

    def _ecc(self, d) -> int | None:
        try:
            h = self._handle(d)
            return None if h is None else int(self.nv.nvmlDeviceGetTotalEccErrors(
                h, self.nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.nv.NVML_VOLATILE_ECC))
        except self.nv.NVMLError:
            return None

    def _drain_xids(self) -> None:
        """The critical Xid events since the last look, by GPU index (NVML's)."""
        while self.events is not None:
            try:
                event = self.nv.nvmlEventSetWait_v2(self.events, 0)
                index = str(self.nv.nvmlDeviceGetIndex(event.device))
            except self.nv.NVMLError:  # a timeout: none left
                return
            self.xids.setdefault(index, []).append(int(event.eventData))

    def why(self, d) -> str | None:
        """Why NVML says GPU `d` is unhealthy, or None."""
        nv = self.nv
        try:
            h = self._handle(d)
        except (nv.NVMLError_GpuIsLost, nv.NVMLError_NotFound) as exc:
            return f"NVML: {exc}"
        except nv.NVMLError:
            return None
        if h is None:
            return None
        index = None
        with contextlib.suppress(nv.NVMLError):
            index = str(nv.nvmlDeviceGetIndex(h))
        if hard := [x for x in self.xids.get(index, []) if x in XID_HARDWARE]:
            return f"NVML: Xid {hard[-1]}"
        if (ecc := self._ecc(d)) is not None and ecc > self.ecc.get(d.name, 0):
            return f"NVML: {ecc - self.ecc.get(d.name, 0)} uncorrected ECC errors since the launch began"
        with contextlib.suppress(nv.NVMLError):
            if nv.nvmlDeviceGetRetiredPagesPendingStatus(h) == nv.NVML_FEATURE_ENABLED:
                return "NVML: retired pages pending (the GPU needs a reset)"
        with contextlib.suppress(nv.NVMLError, ValueError, TypeError):
            if nv.nvmlDeviceGetRemappedRows(h)[3]:
                return "NVML: row remapping failed"
        return None

    def unhealthy(self, devices: Sequence) -> list:
        """(device, why) of each GPU of `devices` NVML says is unhealthy."""
        if self.nv is None:
            return []
        self._drain_xids()
        return [(d, why) for d in devices if d.name.startswith("cuda:")
                and (why := self.why(d)) is not None]

    def close(self) -> None:
        if self.nv is None:
            return
        with contextlib.suppress(self.nv.NVMLError):
            if self.events is not None:
                self.nv.nvmlEventSetFree(self.events)
            self.nv.nvmlShutdown()
        self.nv = None
