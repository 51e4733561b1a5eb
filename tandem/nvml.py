"""The GPU's own gauges, read through NVML (the `pynvml` module of nvidia-ml-py).

`open_gpu(device)` finds the NVML handle of the CUDA device a worker runs on: by its UUID, which
names the same GPU whatever CUDA_VISIBLE_DEVICES renumbered, else by its PCI bus id. It returns
None on a CPU device, and None with one warning logged where NVML cannot be used (no library, no
driver, a device NVML does not list), so a worker then exports no GPU gauges at all rather than
zeros. `GpuGauges.read()` is called when `/metrics` is scraped, on the metrics server's thread,
never by the engine; a reading that fails leaves that reading out of the snapshot (and counts
the failure), the others are still read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("tandem.nvml")

# Bits of nvmlDeviceGetCurrentClocksEventReasons (formerly "throttle reasons"), as nvml.h names
# them; a set bit the table does not know is reported as "other".
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x001: "gpu_idle",
    0x002: "applications_clocks_setting",
    0x004: "sw_power_cap",
    0x008: "hw_slowdown",
    0x010: "sync_boost",
    0x020: "sw_thermal_slowdown",
    0x040: "hw_thermal_slowdown",
    0x080: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

# nvml.h constants (stable across driver versions): nvmlTemperatureSensors_t, nvmlClockType_t.
_TEMPERATURE_GPU = 0
_CLOCK_SM = 1
_CLOCK_MEM = 2


@dataclass
class GpuSnapshot:
    """One reading of the device; None where NVML could not give that value."""

    sm_utilization: float | None = None  # fraction of the sample period a kernel ran
    memory_utilization: float | None = None  # fraction of it device memory was read or written
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    power_watts: float | None = None
    temperature_celsius: float | None = None
    sm_clock_hz: float | None = None
    memory_clock_hz: float | None = None
    clock_event_reasons: int | None = None  # the bit mask of CLOCK_EVENT_REASONS

    def throttle_reasons(self) -> dict[str, int]:
        """Each known reason (and "other") -> 1 when its bit is set, else 0; {} when unread."""
        mask = self.clock_event_reasons
        if mask is None:
            return {}
        out = {name: int(bool(mask & bit)) for bit, name in CLOCK_EVENT_REASONS.items()}
        known = 0
        for bit in CLOCK_EVENT_REASONS:
            known |= bit
        out["other"] = int(bool(mask & ~known))
        return out


@dataclass
class GpuGauges:
    """An NVML device handle and what reading it has cost in errors."""

    nvml: Any  # the pynvml module
    handle: Any
    name: str
    uuid: str
    errors: dict[str, int] = field(default_factory=dict)  # reading -> failures

    def read(self) -> GpuSnapshot:
        """Read every gauge now; a reading that fails is None in the snapshot."""
        nv, h = self.nvml, self.handle
        s = GpuSnapshot()
        util = self._try("utilization", nv.nvmlDeviceGetUtilizationRates, h)
        if util is not None:
            s.sm_utilization = util.gpu / 100.0
            s.memory_utilization = util.memory / 100.0
        mem = self._try("memory", nv.nvmlDeviceGetMemoryInfo, h)
        if mem is not None:
            s.memory_used_bytes, s.memory_total_bytes = int(mem.used), int(mem.total)
        mw = self._try("power", nv.nvmlDeviceGetPowerUsage, h)
        if mw is not None:
            s.power_watts = mw / 1000.0
        temp = self._try("temperature", nv.nvmlDeviceGetTemperature, h, _TEMPERATURE_GPU)
        s.temperature_celsius = None if temp is None else float(temp)
        mhz = self._try("sm_clock", nv.nvmlDeviceGetClockInfo, h, _CLOCK_SM)
        if mhz is not None:
            s.sm_clock_hz = mhz * 1e6
        mhz = self._try("memory_clock", nv.nvmlDeviceGetClockInfo, h, _CLOCK_MEM)
        if mhz is not None:
            s.memory_clock_hz = mhz * 1e6
        # The newer name; drivers' bindings before it only have the "throttle reasons" one.
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if reasons is None:
            reasons = nv.nvmlDeviceGetCurrentClocksThrottleReasons
        s.clock_event_reasons = self._try("clock_event_reasons", reasons, h)
        return s

    def _try(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - NVMLError_NotSupported and kin: skip this one
            n = self.errors.get(what, 0)
            self.errors[what] = n + 1
            if n == 0:
                log.warning("NVML cannot read %s of GPU %s: %s", what, self.uuid, e)
            return None


def open_gpu(device: torch.device) -> GpuGauges | None:
    """The NVML gauges of CUDA `device`; None on a CPU device or where NVML is unusable (one
    warning logged)."""
    if device.type != "cuda":
        return None
    idx = device.index if device.index is not None else torch.cuda.current_device()
    try:
        import pynvml as nv
    except ImportError as e:
        log.warning("no GPU gauges: nvidia-ml-py is not installed (%s)", e)
        return None
    try:
        nv.nvmlInit()
    except Exception as e:  # noqa: BLE001 - no driver library, no permission, ...
        log.warning("no GPU gauges: NVML did not initialise: %s", e)
        return None
    props = torch.cuda.get_device_properties(idx)
    uuid = str(props.uuid)
    if not uuid.startswith(("GPU-", "MIG-")):  # torch omits NVML's prefix
        uuid = "GPU-" + uuid
    try:
        handle = nv.nvmlDeviceGetHandleByUUID(uuid)
    except Exception as by_uuid:  # noqa: BLE001 - then by PCI bus id
        bus = _pci_bus_id(props)
        try:
            if bus is None:
                raise by_uuid
            handle = nv.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception as e:  # noqa: BLE001
            log.warning(
                "no GPU gauges: NVML has no device %s (CUDA device %d, PCI %s): %s",
                uuid,
                idx,
                bus or "unknown",
                e,
            )
            return None
    name = props.name
    return GpuGauges(nv, handle, name, uuid)


def _pci_bus_id(props: Any) -> str | None:
    """NVML's "domain:bus:device.0" form of a device's PCI address (None: torch lacks it)."""
    try:
        return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except AttributeError:
        return None
