"""The real executor: loads the model and runs each step's forward pass."""
from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import logging
import os
from types import ModuleType
from typing import Any

import torch

from framework.execution.attention import BACKENDS
from framework.common.clock import Clock
from framework.common.config import EngineConfig, resolve_dtype_name
from framework.common.registry import UnavailableError
from framework.execution.executor import (EXECUTORS, GiB, Executor, ExecutorOutput, check_kv_capacity,
                                         size_kv_cache)
from framework.execution.cpu_features import cpu_has_amx_bf16, cpu_has_matmul_instructions
from framework.execution.cuda_graphs import DecodeGraphs, capture_sizes
from framework.execution.host_memory import keep_freed_memory, lazy_zeros
from framework.execution.input_preparer import PREPARERS
from framework.execution.memory_profile import dummy_steps, peak_bytes, run_dummy_step
from framework.execution.model_runner import LaunchedStep, ModelRunner
from framework.execution.sampler import Sampler
from framework.scheduling.output import SchedulerOutput
from models.cpu_ops import amx_linear, fused_ops
from models.llama import LlamaForCausalLM, compute_linears_in_float32, pad_linear_rows, use_amx_linears
from models.loader import ModelSource, iter_checkpoint, load_tokenizer
from models.presets import SHAPE_ONLY_PRESETS

logger = logging.getLogger(__name__)

#: Environment variable naming the device ``device="auto"`` means (the test suite pins it to ``cpu``).
DEVICE_ENV = "SERVELAB_DEVICE"


def resolve_device(name: str) -> torch.device:
    """``name`` as a device; ``auto`` is ``$SERVELAB_DEVICE`` when set, else CUDA when available, else
    the CPU. ValueError for a CUDA device without CUDA."""
    if name == "auto":
        name = os.environ.get(DEVICE_ENV) or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use device=cpu or auto")
    return device


def resolve_dtype(name: str, model_dtype: str | None, device: torch.device) -> torch.dtype:
    default = "float32" if device.type == "cpu" else "bfloat16"
    return getattr(torch, resolve_dtype_name(name, model_dtype, device.type, default))


#: (torch's thread count before an engine set one, the count it set); None when none is set.
_threads: tuple[int, int] | None = None


def set_num_threads(num_threads: int | None) -> None:
    """Run torch on ``num_threads`` threads; None: on the process's own count (torch's default or the
    caller's), also after an earlier engine in this process chose one (the setting is per process, and
    a Hydra sweep's jobs or a reused joblib worker share it)."""
    global _threads
    current = torch.get_num_threads()
    # The count before an engine's choice, unless the caller set one of their own since.
    before = _threads[0] if _threads is not None and current == _threads[1] else current
    _threads = (before, num_threads) if num_threads else None
    wanted = num_threads or before
    if wanted != current:
        torch.set_num_threads(wanted)


def _fused_ops(device: torch.device) -> ModuleType | None:
    """The model's fused operators for ``device``: C++ on a CPU, Triton on CUDA; None (with a warning) where
    they cannot be had, and elsewhere."""
    try:
        if device.type == "cuda":
            return importlib.import_module("models.cuda_ops")
        return fused_ops() if device.type == "cpu" else None
    except (ImportError, UnavailableError) as exc:  # ImportError: no triton for the CUDA ones
        logger.warning("the fused operators cannot be had (%s); the model runs torch's operators "
                       "(executor.fused_ops=false silences this)", exc)
        return None


def tune_decode_matmuls(model: torch.nn.Module, rows: list[int]) -> list:
    """``models.cuda_matmul.tune``: its table of choices (UnavailableError without triton)."""
    try:
        cuda_matmul = importlib.import_module("models.cuda_matmul")
    except ImportError as exc:
        raise UnavailableError(f"executor.decode_matmul=tuned needs the triton package ({exc}); install it with "
                               f"`pip install triton`, or use decode_matmul=torch") from exc
    with torch.inference_mode():
        return cuda_matmul.tune(model, rows, cache=cuda_matmul.cache_path())


def _check_amx(device: torch.device, dtype: torch.dtype, float32_matmul: bool | str) -> None:
    """ValueError where ``executor.amx_matmul=true`` cannot apply: its kernel multiplies bf16 on a CPU (whether this
    CPU has the tiles, ``_amx_ops`` finds out, before the weights load too)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        raise ValueError(f"executor.amx_matmul=true multiplies bf16 on a CPU, and this engine runs {str(dtype)[6:]} on "
                         f"{device}; use amx_matmul=auto or false")
    if float32_matmul is True:
        raise ValueError("executor.amx_matmul=true multiplies bf16 weights, which float32_matmul=true replaces by "
                         "float32 copies; set one of them off")


def _amx_ops(required: bool) -> ModuleType | None:
    """``models.cpu_ops.amx_linear()``; where it cannot be had, UnavailableError when ``required``, else a warning and
    None (the products stay torch's)."""
    try:
        return amx_linear()
    except UnavailableError as exc:
        if required:
            raise UnavailableError(f"executor.amx_matmul=true: {exc}; use amx_matmul=auto or false") from exc
        logger.warning("the AMX linear layers cannot be had (%s); products run on torch's "
                       "(executor.amx_matmul=false silences this)", exc)
        return None


def _check_prefetch(device: torch.device, fused_ops: bool, megabytes: int) -> None:
    """ValueError where ``executor.weight_prefetch_mb`` cannot run: its prefetch is Hopper's bulk
    ``cp.async.bulk.prefetch.L2``, issued by the fused CUDA operators, into an L2 cache it must fit."""
    if device.type != "cuda":
        raise ValueError(f"executor.weight_prefetch_mb needs a CUDA device, not {device}; use weight_prefetch_mb=0")
    properties = torch.cuda.get_device_properties(device)
    if (properties.major, properties.minor) < (9, 0):
        raise ValueError(f"executor.weight_prefetch_mb needs a GPU of compute capability 9.0 or later (its bulk L2 "
                         f"prefetch); {device} is {properties.major}.{properties.minor}: use weight_prefetch_mb=0")
    l2_mb = properties.L2_cache_size >> 20
    if megabytes > l2_mb:  # the window's end would evict its start before the product reads it
        raise ValueError(f"executor.weight_prefetch_mb={megabytes} is more than {device}'s L2 cache ({l2_mb} MiB); "
                         f"use 1 to {l2_mb}, or 0 (off)")
    if not fused_ops:
        raise ValueError("executor.weight_prefetch_mb needs executor.fused_ops=true (the fused operators issue "
                         "the prefetches); use weight_prefetch_mb=0")


def graph_backends() -> list[str]:
    """The registered attention backends that can capture decode steps in CUDA graphs."""
    return [name for name in BACKENDS.list() if BACKENDS.get(name).graph_decode]


@EXECUTORS.register("model")
class ModelExecutor(Executor):
    """Options (``executor_options``): ``fused_ops`` (default true): the model's elementwise steps run as
    fused operators, C++ on a CPU (``models.cpu_ops``, the sampler's argmax too), Triton on CUDA
    (``models.cuda_ops``), falling back to torch's with a warning when they cannot be had; false:
    torch's. ``float32_matmul`` (``auto``, ``true``, ``false``): a bf16/fp16 model's linear layers
    multiply in float32 (``compute_linears_in_float32``); ``auto``: on a CPU whose flags
    (``/proc/cpuinfo``) show no matrix instructions for that dtype. ``pad_matmul_rows`` (``auto``, ``true``,
    ``false``): linear layers multiply up to 1/8 more rows, so that their products come in about 100 row
    counts (``models.llama.pad_linear_rows``); ``auto``: where oneDNN runs them, half-precision products on a
    CPU. ``amx_matmul`` (``auto``, ``true``, ``false``): a bf16 model's linear layers multiply up to
    ``models.llama.AMX_MAX_ROWS`` rows on a C++ kernel over Intel AMX tiles (``models.llama.use_amx_linears``), without
    oneDNN's per-call cost; ``auto``: on a CPU with the tiles, unless ``float32_matmul``. ``cuda_graphs`` (``auto``,
    ``true``, ``false``): decode steps replay CUDA graphs captured at padded
    batch sizes (``framework.execution.cuda_graphs``); ``auto``: on CUDA with a backend that can. ``decode_matmul``
    (``torch``, ``tuned``): ``tuned`` (CUDA) times torch's product against a split-K Triton kernel per linear
    layer shape at start-up and runs the faster at up to 128 rows (``models.cuda_matmul``).
    ``weight_prefetch_mb`` (default 0: off): each fused operator asks the L2 cache for the next this many MiB of
    weights from the matrix product after it (``LlamaForCausalLM.prefetch_weights``; CUDA, capability 9.0+)."""

    samples_forks = True  # the v0 preparer samples every fork from its leader's logits row
    returns_logprobs = True
    supports_async = True

    def __init__(self, config: EngineConfig, source: ModelSource, clock: Clock, fused_ops: bool = True,
                 float32_matmul: bool | str = "auto", pad_matmul_rows: bool | str = "auto",
                 amx_matmul: bool | str = "auto", cuda_graphs: bool | str = "auto", decode_matmul: str = "torch",
                 weight_prefetch_mb: int = 0) -> None:
        super().__init__(config, source, clock)
        self.check_values(fused_ops, float32_matmul, pad_matmul_rows, amx_matmul, cuda_graphs, decode_matmul,
                          weight_prefetch_mb)
        if source.is_preset and source.name in SHAPE_ONLY_PRESETS:
            raise ValueError(
                f"model {source.name!r} is a shape-only preset (no weights): run it with executor=sim, or "
                f"pass a Hugging Face checkpoint directory to the model executor")
        cfg = source.config
        set_num_threads(config.num_threads)  # here, not in the engine: a simulated run never loads torch
        self._device = resolve_device(config.device)
        if self._device.type == "cpu":
            keep_freed_memory()
        self.dtype = resolve_dtype(config.dtype, cfg.torch_dtype, self._device)
        if decode_matmul == "tuned" and self._device.type != "cuda":
            raise ValueError(f"executor.decode_matmul=tuned needs a CUDA device (its kernels are timed there), not "
                             f"{self._device}; use decode_matmul=torch")
        if amx_matmul is True:
            _check_amx(self._device, self.dtype, float32_matmul)
        if weight_prefetch_mb:
            _check_prefetch(self._device, fused_ops, weight_prefetch_mb)
            if float32_matmul is True and self.dtype != torch.float32:
                raise ValueError("executor.weight_prefetch_mb prefetches the model's own weights, which "
                                 "float32_matmul=true replaces by float32 copies; set one of them off")
        assert config.max_model_len is not None
        self.backend = BACKENDS.create_with(
            config.backend, config.backend_options, num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, scale=cfg.head_dim ** -0.5,
            block_size=config.block_size, dtype=self.dtype, device=self._device)
        # Before the weights load, so that a bad preparer option costs no load.
        self._preparer = PREPARERS.create_with(
            config.preparer, config.preparer_options, max_num_reqs=config.max_num_seqs,
            max_model_len=config.max_model_len, block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens, device=self._device, check=config.check_invariants)
        self.cuda_graphs = self._use_cuda_graphs(cuda_graphs)
        if config.backend_options.get("fuse_rotary") and not self.cuda_graphs:
            logger.warning("backend.fuse_rotary applies to decode steps replayed from CUDA graphs, and this engine "
                           "captures none (executor.cuda_graphs=%s on %s): it changes nothing", cuda_graphs,
                           self._device)
        if self._device.type != "cuda" or config.kv_cache_memory_gb is not None:
            # The KV cache's size needs no profiled step: a cache that cannot hold a request is refused before the
            # weights load.
            check_kv_capacity(config, self.kv_block_counts()[0])
        self.fused_ops = ops = _fused_ops(self._device) if fused_ops else None
        if float32_matmul == "auto":  # only half-precision models are asked about
            float32_matmul = (self.dtype != torch.float32 and self._device.type == "cpu"
                              and not cpu_has_matmul_instructions(self.dtype))
        use_amx = amx_matmul is True or (amx_matmul == "auto" and self._device.type == "cpu"
                                         and self.dtype == torch.bfloat16 and not float32_matmul and cpu_has_amx_bf16())
        amx_ops = _amx_ops(required=amx_matmul is True) if use_amx else None
        self.model = LlamaForCausalLM.empty_on(self._device, cfg, self.backend, config.max_model_len, self.dtype, ops,
                                               pack_weights=bool(weight_prefetch_mb))
        if source.path is None:
            self.model.init_random(config.model_seed, cfg.initializer_range)
        else:
            self.model.load_weights(iter_checkpoint(source.path))
        if float32_matmul and self.dtype != torch.float32:
            compute_linears_in_float32(self.model)
        if pad_matmul_rows == "auto":  # float32 products run on MKL, which compiles nothing per shape
            pad_matmul_rows = self._device.type == "cpu" and self.dtype != torch.float32 and not float32_matmul
        if pad_matmul_rows:
            pad_linear_rows(self.model)
        #: How many linear layers multiply on the AMX kernel.
        self.amx_linears = use_amx_linears(self.model, amx_ops) if amx_ops is not None else 0
        #: ``models.cuda_matmul.Choice`` per weight shape and row bucket, with ``decode_matmul=tuned``.
        self.matmul_choices = []
        if decode_matmul == "tuned":
            with self._on_device():
                self.matmul_choices = tune_decode_matmuls(self.model, capture_sizes(config.max_num_seqs))
        if weight_prefetch_mb:
            if ops is None:
                raise UnavailableError("executor.weight_prefetch_mb needs the fused operators, which cannot be had "
                                       "here (see the warning above); use weight_prefetch_mb=0")
            self.model.prefetch_weights(weight_prefetch_mb << 20)
        self.model.eval()
        self._tokenizer = self.load_tokenizer(source)
        self.runner: ModelRunner | None = None

    @classmethod
    def load_tokenizer(cls, source: ModelSource) -> Any | None:
        return load_tokenizer(source)

    @staticmethod
    def check_values(fused_ops: bool = True, float32_matmul: bool | str = "auto",
                     pad_matmul_rows: bool | str = "auto", amx_matmul: bool | str = "auto",
                     cuda_graphs: bool | str = "auto", decode_matmul: str = "torch",
                     weight_prefetch_mb: int = 0) -> None:
        """ValueError naming the first option whose value is none of its choices (whatever the device)."""
        for name, value in (("float32_matmul", float32_matmul), ("pad_matmul_rows", pad_matmul_rows),
                            ("amx_matmul", amx_matmul), ("cuda_graphs", cuda_graphs)):
            # `is`: 1 == True and 0 == False, and 1 would read as off where an option tests `is True`.
            if not (value is True or value is False or value == "auto"):
                raise ValueError(f"executor.{name} must be auto, true or false, got {value!r}")
        if not isinstance(fused_ops, bool):
            raise ValueError(f"executor.fused_ops must be true or false, got {fused_ops!r}")
        if decode_matmul not in ("torch", "tuned"):
            raise ValueError(f"executor.decode_matmul must be torch or tuned, got {decode_matmul!r}")
        if type(weight_prefetch_mb) is not int or weight_prefetch_mb < 0:
            raise ValueError(f"executor.weight_prefetch_mb must be a whole number of MiB >= 0 (0: off), got "
                             f"{weight_prefetch_mb!r}")

    def _use_cuda_graphs(self, option: bool | str) -> bool:
        """``executor.cuda_graphs`` resolved for this device and backend; ValueError for ``true`` where
        it cannot be."""
        name = self.config.backend
        capable = type(self.backend).graph_decode
        if option is True and self._device.type != "cuda":
            raise ValueError(f"executor.cuda_graphs=true needs a CUDA device, not {self._device}; use auto or false")
        if option is True and not capable:
            raise ValueError(f"executor.cuda_graphs=true: attention backend {name!r} cannot capture decode steps; "
                             f"use backend={' or backend='.join(graph_backends())}, or cuda_graphs=auto or false")
        if option == "auto" and self._device.type == "cuda" and not capable:
            logger.info("attention backend %r cannot capture decode steps: they run eagerly (CUDA graphs with "
                        "backend=%s)", name, " or ".join(graph_backends()))
        return option is True or (option == "auto" and self._device.type == "cuda" and capable)

    def _on_device(self) -> contextlib.AbstractContextManager:
        """This engine's CUDA device the current one inside (Triton launches on the current device), so that an
        engine on ``cuda:1`` runs there; nothing on a CPU."""
        return torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext()

    @property
    def tokenizer(self) -> Any | None:
        return self._tokenizer

    @property
    def device(self) -> str:
        return str(self._device)

    @property
    def bytes_per_block(self) -> int:
        """One KV block (all layers, K and V): what the KV budget is divided into."""
        return self.config.block_size * self.source.config.kv_bytes_per_token(self.dtype.itemsize)

    def kv_block_counts(self) -> tuple[int, int]:
        return size_kv_cache(self.config, self.bytes_per_block, self._device_budget)

    def _device_budget(self) -> float:
        """Bytes for the KV cache: on a GPU, its share of memory less what is in use (weights, CUDA context)
        and what a step needs on top (``profile_step_bytes``, at least the backend's declared workspace)."""
        if self._device.type != "cuda":
            return self.config.cpu_kv_cache_gb * GiB
        config = self.config
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        workspace = self.backend.workspace_bytes(config.max_num_seqs, config.max_model_len,
                                                 config.max_num_batched_tokens)
        step = max(self.profile_step_bytes(), workspace)
        # An earlier engine the caller dropped may be held by a reference cycle only (the first engine of a process
        # is: importing torch inside it leaves one): collected here, its cache counts as free, as what this
        # process's allocator caches does.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self._device)
        return max(0.0, total * config.gpu_memory_utilization - (total - free) - step)

    def profile_step_bytes(self) -> int:
        """The peak CUDA memory of this engine's worst-case steps (``memory_profile.dummy_steps``: forward,
        logits, sampling), and with CUDA graphs the decode step's once more, which their memory pool keeps."""
        with self._on_device():
            return self._profile_step_bytes()

    def _profile_step_bytes(self) -> int:
        cfg, config = self.source.config, self.config
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None
        cache = torch.zeros(2, cfg.num_hidden_layers, 1, config.block_size, cfg.num_key_value_heads, cfg.head_dim,
                            dtype=self.dtype, device=self._device)
        sampler = Sampler(torch.Generator(device=self._device).manual_seed(0))
        peaks = {}
        for step in dummy_steps(config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len):
            run = functools.partial(run_dummy_step, step, self.model, self.backend, sampler, cache, cfg.vocab_size)
            peaks[step.name] = peak_bytes(run, self._device)
        del cache
        peak = max(peaks.values()) + (peaks["decode"] if self.cuda_graphs else 0)
        logger.info("profiled step memory: %s MiB%s", ", ".join(f"{k} {v / 2**20:.1f}" for k, v in peaks.items()),
                    " (the decode step's kept for CUDA graphs)" if self.cuda_graphs else "")
        return peak

    def initialize(self, num_blocks: int, num_cpu_blocks: int) -> None:
        with self._on_device():
            self._initialize(num_blocks, num_cpu_blocks)

    def _initialize(self, num_blocks: int, num_cpu_blocks: int) -> None:
        cfg, config = self.source.config, self.config
        kv_cache = lazy_zeros((2, cfg.num_hidden_layers, num_blocks, config.block_size, cfg.num_key_value_heads,
                               cfg.head_dim), self.dtype, self._device)
        preparer = self._preparer
        generator = torch.Generator(device=self._device).manual_seed(config.seed)
        decode = None
        if self.cuda_graphs:
            decode = DecodeGraphs(self.model, self.backend, kv_cache, capture_sizes(config.max_num_seqs),
                                  config.max_model_len, config.block_size)
        sampler = Sampler(generator, self.fused_ops)
        self.runner = ModelRunner(self.model, self.backend, preparer, sampler, kv_cache, num_cpu_blocks, decode,
                                  max_logit_rows=config.max_num_seqs)
        logger.info("KV cache: %d blocks x %d tokens (%.1f MiB), swap space %d blocks", num_blocks,
                    config.block_size, kv_cache.numel() * kv_cache.element_size() / 2**20, num_cpu_blocks)

    def execute(self, out: SchedulerOutput) -> ExecutorOutput:
        assert self.runner is not None, "initialize() must be called before execute()"
        with self._on_device():
            return self.runner.execute(out)

    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        assert self.runner is not None, "initialize() must be called before launch()"
        with self._on_device():
            return self.runner.launch(out)

    def collect(self, handle: LaunchedStep) -> ExecutorOutput:
        assert self.runner is not None, "initialize() must be called before collect()"
        return self.runner.collect(handle)
