"""The roofline cost model: each part of a step takes the longer of its compute and memory time, plus overheads.

Per tensor-parallel device, for ``N`` scheduled tokens of which ``S`` sample, each time derated by an efficiency
factor: linear layers ``2 N P`` FLOPs and their weights, inputs and outputs in bytes (``P``: the device's share of
the matrices), the LM head likewise for ``S`` rows; attention ``4 d H`` FLOPs per query-key pair and its keys and
values read once; the KV write, norms, RoPE, activation and residuals as memory traffic; two ring all-reduces per
layer, one after the embedding and a logits gather over the interconnect; swaps over PCIe; overheads per step,
request, token and kernel launch; and, off by default, ``extra_weight_passes(N)`` more reads of the layers'
weights (interpolated between its token counts, held beyond), as small GEMMs may stream their weights repeatedly.
"""
from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from framework.common.config import DTYPE_ALIASES, is_finite_number, parse_finite_float, read_yaml
from framework.sim.cost_model import COST_MODELS, BatchShape, CostModel, model_shape
from framework.sim.hardware import Hardware
from models.config import ModelConfig

logger = logging.getLogger(__name__)

#: Fitted parameters and their defaults (a vLLM-like stack on a datacenter GPU, uncalibrated).
PARAMS: dict[str, float] = {
    "matmul_efficiency": 0.7,       # fraction of peak FLOP/s dense GEMMs reach
    "memory_efficiency": 0.8,       # fraction of bandwidth weight and activation streams reach
    "attention_efficiency": 0.5,    # fraction of peak FLOP/s prefill attention reaches
    "kv_efficiency": 0.6,           # fraction of bandwidth paged KV reads reach
    "step_overhead_us": 1000.0,     # scheduler, input preparation, sampling: per step
    "seq_overhead_us": 20.0,        # ... per scheduled request (and per-request kernels)
    "token_overhead_us": 0.0,       # ... per scheduled token
}
#: Structure, not fitted: kernels launched per decoder layer and per step outside the layers.
STRUCTURE: dict[str, float] = {"kernels_per_layer": 12, "kernels_per_step": 6}
#: Fitted per token count, not a scalar: ``{tokens: extra passes over the layers' weights}``.
CURVE = "extra_weight_passes"
_EFFICIENCIES = ("matmul_efficiency", "memory_efficiency", "attention_efficiency", "kv_efficiency")
_OVERHEADS = ("step_overhead_us", "seq_overhead_us", "token_overhead_us")


@COST_MODELS.register("roofline")
class RooflineCostModel(CostModel):
    """Options: any of ``PARAMS`` and ``STRUCTURE``, ``extra_weight_passes`` (``CURVE``), and
    ``calibration`` (a YAML written by ``python -m framework.profile``, whose fitted parameters
    apply under the explicit ones)."""

    def __init__(self, model: ModelConfig, hardware: Hardware, dtype_bytes: int = 2, tensor_parallel_size: int = 1,
                 block_size: int = 16, calibration: str | Path | dict[str, Any] | None = None,
                 extra_weight_passes: Mapping[int, float] | None = None, *, dtype: str | None = None,
                 **options: float) -> None:
        super().__init__(model, hardware, dtype_bytes, tensor_parallel_size, block_size, dtype=dtype)
        unknown = sorted(set(options) - set(PARAMS) - set(STRUCTURE))
        if unknown:
            raise ValueError(f"unknown roofline option(s) {unknown}; options: "
                             f"{sorted(PARAMS) + sorted(STRUCTURE) + [CURVE, 'calibration']}")
        self.calibration = load_calibration(calibration) if calibration is not None else None
        fitted = self.calibration["params"] if self.calibration else {}
        if self.calibration:
            self._warn_if_fitted_elsewhere(self.calibration)
        source = "calibration" if isinstance(calibration, dict) else f"calibration {str(calibration)!r}"
        self.params = {**PARAMS, **{k: _number(k, v, source) for k, v in fitted.items() if k in PARAMS},
                       **{k: _number(k, v) for k, v in options.items() if k in PARAMS}}
        self.structure = {**STRUCTURE, **{k: _number(k, v) for k, v in options.items() if k in STRUCTURE}}
        for name in _EFFICIENCIES:
            if not self.params[name] > 0:
                raise ValueError(f"roofline {name} must be > 0, got {self.params[name]!r}")
        for name in _OVERHEADS:
            if self.params[name] < 0:
                raise ValueError(f"roofline {name} must be >= 0, got {self.params[name]!r}")
        for name, value in self.structure.items():
            if value < 0:
                raise ValueError(f"roofline {name} must be >= 0, got {value!r}")
        if extra_weight_passes is not None:
            self.extra_weight_passes = _check_curve(extra_weight_passes)
        else:
            self.extra_weight_passes = _check_curve(fitted.get(CURVE), source)
        self._knots = np.array(list(self.extra_weight_passes), dtype=float)
        self._passes = np.array(list(self.extra_weight_passes.values()), dtype=float)
        self._geometry()
        p = self.params
        self._inv = [1.0 / p[name] for name in _EFFICIENCIES]
        self._step, self._seq, self._tok = (p[name] * 1e-6 for name in _OVERHEADS)
        self._decode_slope = self._decode_ctx_c * self._inv[2]
        if self._decode_ctx_m * self._inv[3] > self._decode_slope:
            self._decode_slope = self._decode_ctx_m * self._inv[3]
        self._decode_base: dict[int, float] = {}

    # -- geometry: per-device sizes and unit-efficiency times --------------------------------------
    def _geometry(self) -> None:
        m, hw, tp, b = self.model, self.hardware, self.tp, self.dtype_bytes
        h, L = m.hidden_size, m.num_hidden_layers
        qs = m.num_attention_heads // tp * m.head_dim
        kvs = m.kv_size_per_device(tp)
        inter = m.intermediate_size // tp
        vocab = m.vocab_size / tp
        F, B = hw.peak_flops(self.dtype), hw.memory_bandwidth  # the peak of the model's dtype
        layer_params = h * (qs + 2 * kvs) + qs * h + 3 * h * inter
        gemm_io = 4 * h + 2 * qs + 2 * kvs + 3 * inter          # GEMM inputs and outputs, per token
        elementwise_io = 9 * h + 3 * inter + 4 * qs + 4 * kvs   # norms, RoPE, act, residuals, KV write, q/o
        self.num_layers = L
        #: Bytes of one KV block on one device (all layers, K and V).
        self.block_bytes = self.block_size * m.kv_bytes_per_token(b, tp)
        # Seconds at 100% efficiency: compute (c) and memory (m) legs, per unit of their driver.
        self._lin_c_tok = 2 * L * layer_params / F
        self._lin_m_fixed = L * layer_params * b / B
        self._lin_m_tok = L * gemm_io * b / B
        self._head_c_row = 2 * h * vocab / F
        self._head_m_fixed = h * vocab * b / B
        # Logits come out of the LM head in the model's dtype, as in vLLM (the sampler's float32
        # copy is part of the per-request sampling overhead).
        self._head_m_row = (h + vocab) * b / B
        self._elem_m_tok = (L * elementwise_io + h) * b / B      # + the embedding gather
        self._copy_m_block = 2 * self.block_bytes / B
        self._pre_c_pair = 4 * L * qs / F
        self._pre_m_ctx = 2 * L * kvs * b / B
        self._decode_ctx_c = 4 * L * qs / F
        self._decode_ctx_m = 2 * L * kvs * b / B
        kernels = L * self.structure["kernels_per_layer"] + self.structure["kernels_per_step"]
        self._ar_tok = self._ar_row = self._ar_fixed = 0.0
        if tp > 1:
            if not hw.interconnect_gb_s > 0:
                raise ValueError(f"tensor_parallel_size={tp} needs hardware {hw.name!r} to give interconnect_gb_s")
            ring = 2 * (tp - 1) / tp
            # Two per layer (after attention's o and the MLP's down projection) and one after the
            # vocabulary-parallel embedding, whose devices each look up only their share of the ids.
            self._ar_tok = (2 * L + 1) * ring * h * b / hw.interconnect_bandwidth
            # vLLM gathers the logits as the LM head wrote them, in the model's dtype.
            self._ar_row = (tp - 1) / tp * m.vocab_size * b / hw.interconnect_bandwidth
            self._ar_fixed = (2 * L + 2) * hw.interconnect_latency  # the all-reduces and the logits gather
            kernels += 2 * L + 2
        self._launch = kernels * hw.launch_overhead
        # No PCIe figure: a swap would take forever, which is what the step time then says.
        self._swap_block = self.block_bytes / hw.pcie_bandwidth if hw.pcie_gb_s > 0 else math.inf

    # -- step times ------------------------------------------------------------------------------
    def _base(self, n: int, tokens: int, sampled: int) -> float:
        """Everything but attention, swaps and copies."""
        inv_mm, inv_mem = self._inv[0], self._inv[1]
        lin = max(self._lin_c_tok * tokens * inv_mm, (self._lin_m_fixed + self._lin_m_tok * tokens) * inv_mem)
        head = 0.0
        if sampled:
            head = max(self._head_c_row * sampled * inv_mm, (self._head_m_fixed + self._head_m_row * sampled) * inv_mem)
        if len(self._knots):
            lin += float(np.interp(tokens, self._knots, self._passes)) * self._lin_m_fixed
        cpu = self._step + self._seq * n + self._tok * tokens
        comm = self._ar_fixed + self._ar_tok * tokens + self._ar_row * sampled
        return cpu + self._launch + comm + lin + head + self._elem_m_tok * tokens * inv_mem

    def decode_step_time(self, num_seqs: int, context: int) -> float:
        base = self._decode_base.get(num_seqs)
        if base is None:
            base = self._decode_base[num_seqs] = self._base(num_seqs, num_seqs, num_seqs)
        return base + context * self._decode_slope

    def host_time(self, batch: BatchShape) -> float:
        """The overheads (``step_overhead_us``, ``seq_overhead_us``, ``token_overhead_us``)."""
        if not batch.num_tokens:
            return self._step
        return self._step + self._seq * batch.num_seqs + self._tok * batch.num_tokens

    def step_time(self, batch: BatchShape) -> float:
        if batch.is_pure_decode:
            return self.decode_step_time(batch.num_seqs, batch.decode_context)
        # A step that only moves blocks (a swap-in ahead of its request's turn) runs no model.
        t = self._base(batch.num_seqs, batch.num_tokens, batch.num_sampled) if batch.num_tokens else self._step
        if batch.num_prefill_seqs:
            t += max(self._pre_c_pair * batch.prefill_pairs * self._inv[2],
                     self._pre_m_ctx * batch.prefill_context * self._inv[3])
        t += batch.decode_context * self._decode_slope
        if batch.swap_in_blocks or batch.swap_out_blocks:
            t += (batch.swap_in_blocks + batch.swap_out_blocks) * self._swap_block
        return t + batch.copy_blocks * self._copy_m_block * self._inv[1]

    # -- calibration -----------------------------------------------------------------------------
    def legs(self, batch: BatchShape) -> tuple[float, list[list[tuple[int, float]]]]:
        """``step_time`` as ``offset + sum over groups of max over (param, leg) of theta[param] * leg``,
        where ``theta`` is ``fit_vector()``: what calibration fits."""
        n, tok, s = batch.num_seqs, batch.num_tokens, batch.num_sampled
        offset = 0.0
        if batch.swap_in_blocks or batch.swap_out_blocks:
            offset += (batch.swap_in_blocks + batch.swap_out_blocks) * self._swap_block
        if not tok:
            return offset, [[(4, 1e-6)], [(1, batch.copy_blocks * self._copy_m_block)]]
        offset += self._launch + self._ar_fixed + self._ar_tok * tok + self._ar_row * s
        groups = [
            [(0, self._lin_c_tok * tok), (1, self._lin_m_fixed + self._lin_m_tok * tok)],
            [(1, self._elem_m_tok * tok + batch.copy_blocks * self._copy_m_block)],
            [(2, self._decode_ctx_c * batch.decode_context), (3, self._decode_ctx_m * batch.decode_context)],
            [(4, 1e-6)], [(5, 1e-6 * n)], [(6, 1e-6 * tok)],
        ]
        if s:
            groups.append([(0, self._head_c_row * s), (1, self._head_m_fixed + self._head_m_row * s)])
        if batch.num_prefill_seqs:
            groups.append([(2, self._pre_c_pair * batch.prefill_pairs), (3, self._pre_m_ctx * batch.prefill_context)])
        if len(self._knots):
            # np.interp's weight on each knot. The first knot's value is no parameter: calibration
            # pins it at 0 (passes beyond the smallest batch's), else it trades off against step_overhead.
            for k, unit in enumerate(np.eye(len(self._knots))):
                w = float(np.interp(tok, self._knots, unit))
                if k == 0:
                    offset += w * self._passes[0] * self._lin_m_fixed
                elif w:
                    groups.append([(6 + k, w * self._lin_m_fixed)])
        return offset, groups

    def _warn_if_fitted_elsewhere(self, calibration: Mapping[str, Any]) -> None:
        """Log a warning for each way the calibration's measurements differ from this simulation (device,
        its figures, model shape, dtype, tensor-parallel degree, KV block size), as its efficiencies may not
        carry over. Provenance a calibration leaves out is not checked."""
        # `hardware: null` (a calibration that names no device) is no provenance, as a missing one.
        fitted_hw = calibration.get("hardware") or {}
        fitted_on = fitted_hw.get("name")
        if fitted_on is not None and fitted_on != self.hardware.name:
            logger.warning("calibration fitted on hardware %r applied to %r: its efficiency factors may not carry over",
                           fitted_on, self.hardware.name)
        elif fitted_on is not None:
            # Same device, other figures (an edited preset, a figure overridden): the efficiencies are
            # fractions of the fitted figures, so the times the fit reproduced would change.
            differ = self._figures_differ(fitted_hw, calibration.get("dtype") or self.dtype)
            if differ:
                logger.warning("calibration fitted on hardware %r with other figures than this simulation's (%s): its "
                               "efficiency factors are fractions of them and may not carry over", fitted_on,
                               ", ".join(differ))
        shape = calibration.get("model_shape")
        if isinstance(shape, dict):
            differ = [f"{k} {shape[k]} vs {v}" for k, v in model_shape(self.model).items() if k in shape and shape[k] != v]
            if differ:
                logger.warning("calibration fitted on model %r applied to a model of another shape (%s): its "
                               "efficiency factors may not carry over", calibration.get("model"), ", ".join(differ))
        settings = {"dtype": self.dtype, "dtype_bytes": self.dtype_bytes, "tensor_parallel_size": self.tp,
                    "block_size": self.block_size}
        differ = [f"{k} {calibration[k]} vs {v}" for k, v in settings.items()
                  if calibration.get(k) is not None and calibration[k] != v]
        if differ:
            logger.warning("calibration measured with other settings than this simulation's (%s): its efficiency "
                           "factors may not carry over", ", ".join(differ))

    def _figures_differ(self, fitted_hw: Mapping[str, Any], fitted_dtype: Any) -> list[str]:
        """``"FIGURE fitted vs now"`` for the figures the efficiency factors are fractions of (the
        peak FLOP/s in the dtype measured, when it is this simulation's, and the memory bandwidth)
        where the calibration's device description gives another; figures it lacks are not checked."""
        differ = []
        peaks = fitted_hw.get("peak_tflops")
        if isinstance(fitted_dtype, str) and DTYPE_ALIASES.get(fitted_dtype) == self.dtype:  # else warned as a setting
            fitted_peak = peaks.get(self.dtype) if isinstance(peaks, Mapping) else peaks
            now = self.hardware.peak_flops(self.dtype)
            if is_finite_number(fitted_peak) and fitted_peak * 1e12 != now:
                differ.append(f"{self.dtype} peak_tflops {fitted_peak:g} vs {now / 1e12:g}")
        bandwidth = fitted_hw.get("memory_bandwidth_gb_s")
        if is_finite_number(bandwidth) and bandwidth != self.hardware.memory_bandwidth_gb_s:
            differ.append(f"memory_bandwidth_gb_s {bandwidth:g} vs {self.hardware.memory_bandwidth_gb_s:g}")
        return differ

    def fit_vector(self) -> list[float]:
        return self._inv + [self.params[name] for name in _OVERHEADS] + [float(v) for v in self._passes[1:]]

    @classmethod
    def calibrate(cls, samples: list[tuple[BatchShape, float]], model: ModelConfig, hardware: Hardware,
                  dtype_bytes: int, tensor_parallel_size: int = 1, block_size: int = 16, *,
                  dtype: str | None = None) -> dict[str, Any]:
        from framework.sim.calibration import fit_max_linear, predict

        if len(samples) < len(PARAMS):
            raise ValueError(f"calibration needs at least {len(PARAMS)} measured steps, got {len(samples)}")
        measured = [t for _, t in samples]
        # The curve's knots: the batch sizes of the pure-decode samples, where the token count
        # varies alone (a prefill's tokens move its attention and overheads along with them).
        knots = sorted({s.num_tokens for s, _ in samples if s.is_pure_decode})
        if len(knots) < 2:
            knots = []

        def fit(curve: dict[int, float] | None) -> tuple[list[Any], list[float], list[float]]:
            """The probe's rows, lower bounds and a fit from its default start."""
            probe = cls(model, hardware, dtype_bytes, tensor_parallel_size, block_size, extra_weight_passes=curve,
                        dtype=dtype)
            rows = [probe.legs(shape) for shape, _ in samples]
            # Efficiencies may exceed 1 against nominal figures (e.g. weights that stay in a CPU
            # cache), but not absurdly: theta = 1/efficiency >= 0.01. No batch streams its
            # weights fewer times than the smallest one: the curve's knots are >= its first (0).
            lower = [0.01] * 4 + [0.0] * (3 + max(len(curve or ()) - 1, 0))
            return rows, lower, fit_max_linear(rows, measured, probe.fit_vector(), lower)

        _, _, theta = fit(None)
        if knots:
            rows, lower, from_default = fit(dict.fromkeys(knots, 0.0))
            flat = theta + [0.0] * (len(knots) - 1)  # the fit without the curve, as a curve of zeros
            # The alternation finds a local optimum: start it from the fit without the curve too,
            # and keep that fit itself if neither start beats it, so the curve never fits worse.
            theta = min([from_default, fit_max_linear(rows, measured, flat, lower), flat],
                        key=lambda th: sum((predict(o, g, th) / t - 1) ** 2 for (o, g), t in zip(rows, measured)))
        params: dict[str, Any] = {name: 1.0 / theta[i] for i, name in enumerate(_EFFICIENCIES)}
        params.update({name: theta[4 + i] for i, name in enumerate(_OVERHEADS)})
        if knots:
            params[CURVE] = {int(k): (theta[6 + i] if i else 0.0) for i, k in enumerate(knots)}
        return params


def load_calibration(spec: str | Path | dict[str, Any]) -> dict[str, Any]:
    """A calibration written by ``framework.profile``: a dict with ``params`` (and provenance)."""
    if isinstance(spec, dict):
        data = spec
    elif not isinstance(spec, (str, Path)):  # cost_model.calibration=5 reads as an int
        raise ValueError(f"calibration must be the path of a YAML written by python -m framework.profile, got {spec!r}")
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ValueError(f"calibration file {str(spec)!r} does not exist (write one with python -m framework.profile)")
        data = read_yaml(path, f"calibration file {str(spec)!r}")
    if not isinstance(data, dict) or not isinstance(data.get("params"), dict):
        raise ValueError(f"calibration {spec!r} has no 'params' mapping; was it written by python -m framework.profile?")
    # The provenance is optional, but the hardware the fit was made on is read (to warn when it
    # is applied to another): a mapping with a name, as framework.profile writes it.
    hardware = data.get("hardware")
    if hardware is not None and not isinstance(hardware, dict):
        raise ValueError(f"calibration {spec!r}: 'hardware' must be the device description the fit was made on "
                         f"(a mapping with a 'name'), got {hardware!r}")
    unknown = sorted(set(data["params"]) - set(PARAMS) - {CURVE})
    if unknown:
        raise ValueError(f"calibration {spec!r} has unknown parameter(s) {unknown}; known: {sorted(PARAMS) + [CURVE]}")
    return data


def _number(name: str, value: Any, source: str | None = None) -> float:
    """Parameter ``name``'s ``value`` as a float: a finite number, or a string of one (a hand-written YAML);
    NaN and infinity are refused, as they would pass the range checks. ``source`` names its origin."""
    x = parse_finite_float(value)
    if x is None:
        where = f" (from {source})" if source else ""
        raise ValueError(f"roofline {name}{where} must be a finite number, got {value!r}")
    return x


def _check_curve(curve: Any, source: str | None = None) -> dict[int, float]:
    """``{tokens: extra passes}`` sorted by tokens: tokens positive integers (strings of digits
    too, as YAML or Hydra may give them), passes finite numbers >= 0. ``source`` names where
    the curve came from, for the error."""
    if curve is None:
        return {}
    where = f" (from {source})" if source else ""
    if not isinstance(curve, Mapping):
        raise ValueError(f"roofline {CURVE}{where} must map token counts (positive integers) to extra weight "
                         f"passes (numbers >= 0), e.g. {{1: 0, 4: 1.5}}; got {curve!r}")
    out: dict[int, float] = {}
    for k, v in curve.items():
        try:
            tokens = int(k) if not isinstance(k, (bool, float)) else 0
        except (TypeError, ValueError):
            tokens = 0
        if tokens < 1:
            raise ValueError(f"roofline {CURVE}{where}: token counts must be positive integers, got {k!r}")
        if tokens in out:
            raise ValueError(f"roofline {CURVE}{where}: token count {tokens} is given twice")
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not 0 <= v < math.inf:
            raise ValueError(f"roofline {CURVE}{where}[{tokens}] must be a finite number >= 0, got {v!r}")
        out[tokens] = float(v)
    return dict(sorted(out.items()))
