"""Device descriptions for the simulator's cost models: ``conf/hardware/NAME.yaml`` or a dict of its fields.

Figures are the datasheet's (peak dense matrix throughput, memory bandwidth and size, interconnect) plus the
launch and runtime costs a serving stack pays; how much of the peaks kernels reach is left to the cost model's
efficiency factors. ``peak_tflops`` is one number for every dtype or a mapping ``{dtype: TFLOP/s}``; a dtype
the mapping leaves out cannot be simulated.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Any

from framework.common.config import DTYPE_ALIASES, DTYPE_BYTES, is_finite_number, read_yaml

HARDWARE_DIR = Path(__file__).resolve().parents[2] / "conf" / "hardware"
GiB = 1 << 30


@dataclass(frozen=True)
class Hardware:
    """One device (one GPU of a tensor-parallel group). Units are in the field names."""

    name: str
    #: Dense matrix FLOP/s (x1e12): one number for every dtype, or ``{dtype: TFLOP/s}`` (aliases
    #: such as ``bf16`` are accepted and stored under the canonical name).
    peak_tflops: float | Mapping[str, float]
    memory_bandwidth_gb_s: float
    memory_gib: float
    launch_overhead_us: float = 0.0
    interconnect_gb_s: float = 0.0
    interconnect_latency_us: float = 0.0
    pcie_gb_s: float = 0.0
    runtime_reserved_gib: float = 0.0
    #: What ``dtype=auto`` means on this device (as the model executor resolves it).
    dtype: str = "bfloat16"
    #: ``cuda``: the KV cache gets ``gpu_memory_utilization`` of the memory left by weights and
    #: activations; ``cpu``: it gets ``cpu_kv_cache_gb``, as the model executor does on a CPU.
    device_type: str = "cuda"

    def __post_init__(self) -> None:
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"hardware {self.name!r}: device_type must be 'cuda' or 'cpu', got {self.device_type!r}")
        if self.dtype not in DTYPE_ALIASES:
            raise ValueError(f"hardware {self.name!r}: dtype must be one of {sorted(DTYPE_ALIASES)}, got {self.dtype!r}")
        if isinstance(self.peak_tflops, Mapping):
            # Frozen: the canonical mapping replaces the given one (as __init__ would have set it).
            object.__setattr__(self, "peak_tflops", self._check_peaks(self.peak_tflops))
        # Finite numbers only: a NaN passes both range checks below and makes every step time (or
        # the KV cache size) NaN; a string fails them with a TypeError naming no field.
        for name in ("peak_tflops", "memory_bandwidth_gb_s", "memory_gib"):
            if name == "peak_tflops" and isinstance(self.peak_tflops, dict):
                continue
            value = getattr(self, name)
            if not (is_finite_number(value) and value > 0):
                # peak_tflops may also be a mapping: a list or null is told of that form too.
                valid = (f"a finite number > 0 (every dtype's peak) or a mapping of dtypes ({', '.join(DTYPE_BYTES)}) "
                         f"to TFLOP/s" if name == "peak_tflops" else "a finite number > 0")
                raise ValueError(f"hardware {self.name!r}: {name} must be {valid}, got {value!r}")
        for name in ("launch_overhead_us", "interconnect_gb_s", "interconnect_latency_us", "pcie_gb_s",
                     "runtime_reserved_gib"):
            value = getattr(self, name)
            if not (is_finite_number(value) and value >= 0):
                raise ValueError(f"hardware {self.name!r}: {name} must be a finite number >= 0, got {value!r}")

    def _check_peaks(self, peaks: Mapping[str, Any]) -> dict[str, float]:
        """``peaks`` keyed by canonical dtype names; each a finite number > 0."""
        if not peaks:
            raise ValueError(f"hardware {self.name!r}: peak_tflops must be a number or a mapping of dtypes "
                             f"({', '.join(DTYPE_BYTES)}) to TFLOP/s, got an empty mapping")
        out: dict[str, float] = {}
        given: dict[str, Any] = {}  # the key each canonical dtype was given under, for the error
        for dtype, value in peaks.items():
            canonical = DTYPE_ALIASES.get(dtype) if isinstance(dtype, str) else None
            if canonical is None:
                raise ValueError(f"hardware {self.name!r}: peak_tflops has a peak for {dtype!r}, which is no dtype; "
                                 f"dtypes: {sorted(DTYPE_ALIASES)}")
            if canonical in given:
                raise ValueError(f"hardware {self.name!r}: peak_tflops gives {canonical} twice, as {given[canonical]!r} "
                                 f"and {dtype!r}; give it once")
            given[canonical] = dtype
            if not (is_finite_number(value) and value > 0):
                raise ValueError(f"hardware {self.name!r}: peak_tflops[{dtype}] must be a finite number > 0, "
                                 f"got {value!r}")
            out[canonical] = value
        return out

    def peak_flops(self, dtype: str) -> float:
        """Peak dense matrix FLOP/s in ``dtype`` (a canonical name or an alias); a ValueError
        naming the dtypes this device lists when it lists no peak for ``dtype``."""
        canonical = DTYPE_ALIASES.get(dtype, dtype)
        if not isinstance(self.peak_tflops, dict):
            return self.peak_tflops * 1e12
        if canonical not in self.peak_tflops:
            raise ValueError(f"hardware {self.name!r} gives no peak_tflops for {dtype}; it lists "
                             f"{', '.join(self.peak_tflops)} (add a {canonical} figure to its description)")
        return self.peak_tflops[canonical] * 1e12

    # -- SI units --------------------------------------------------------------------------------
    @property
    def flops(self) -> float:
        """Peak FLOP/s in the device's own dtype (what ``dtype=auto`` runs in on it)."""
        return self.peak_flops(self.dtype)

    @property
    def memory_bandwidth(self) -> float:
        return self.memory_bandwidth_gb_s * 1e9

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GiB

    @property
    def launch_overhead(self) -> float:
        return self.launch_overhead_us * 1e-6

    @property
    def interconnect_bandwidth(self) -> float:
        return self.interconnect_gb_s * 1e9

    @property
    def interconnect_latency(self) -> float:
        return self.interconnect_latency_us * 1e-6

    @property
    def pcie_bandwidth(self) -> float:
        return self.pcie_gb_s * 1e9

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Hardware:
        if not isinstance(d, dict):
            raise ValueError(f"a hardware description is a mapping of its fields (name, peak_tflops, "
                             f"memory_bandwidth_gb_s, memory_gib, ...), got {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown hardware field(s) {unknown}; known fields: {sorted(known)}")
        if "name" not in d:
            raise ValueError("a hardware description needs a 'name'")
        # Named here: the dataclass would say only "__init__() missing 1 required positional argument".
        missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING]
        if missing:
            raise ValueError(f"hardware {d['name']!r} lacks {', '.join(missing)} (a datasheet figure, see conf/hardware/)")
        return cls(**d)


def hardware_presets() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def load_hardware(spec: str | dict[str, Any] | Hardware) -> Hardware:
    """A ``Hardware`` from a preset name (``conf/hardware/NAME.yaml``), a YAML path or a dict."""
    if isinstance(spec, Hardware):
        return spec
    if isinstance(spec, dict):
        return Hardware.from_dict(dict(spec))
    if not isinstance(spec, (str, Path)):  # executor.hardware=null or =5: Path() would raise a bare TypeError
        raise ValueError(f"hardware must be a preset ({', '.join(hardware_presets())}), the path of a YAML file "
                         f"or a mapping of its fields, got {spec!r}")
    path = Path(spec).expanduser()
    if not path.suffix:
        path = HARDWARE_DIR / f"{spec}.yaml"
    if not path.is_file():
        raise ValueError(f"hardware {spec!r} is neither a preset ({', '.join(hardware_presets())}) nor a YAML file")
    data = read_yaml(path, f"hardware file {str(spec)!r}")
    try:
        return Hardware.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"hardware file {str(spec)!r}: {exc}") from None
