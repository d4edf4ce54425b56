"""``LabServer``: a composed config built into an engine, its stepping thread, the app and a listening socket."""
from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import uvicorn
from omegaconf import DictConfig, OmegaConf

from framework.common.clock import WallClock
from framework.common.outputs import RequestOutput
from framework.execution.executor import simulates_time
from framework.harness.experiment import build_cluster, check_run_options, clear_run_dir, engine_config, warm_up
from framework.harness.metrics import SLO
from framework.server.app import build_app
from framework.server.engine_loop import EngineLoop
from framework.server.prometheus import ServerMetrics
from framework.server.recording import ServedRun
from framework.server.serving import Serving
from framework.server.settings import ServerSettings

log = logging.getLogger(__name__)

#: How long shutting down waits for open connections after aborting their requests.
GRACEFUL_SHUTDOWN_S = 10


def check_config(cfg: DictConfig) -> tuple[ServerSettings, Any]:
    """ValueError, one line, for what a server cannot run, before anything heavy: the ``server`` node, the run
    options, the engine config, a simulated executor or clock (a server answers in wall time), a cluster."""
    node = cfg.get("server")
    settings = ServerSettings.from_node(OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig)
                                        else node)
    check_run_options(cfg)
    config = engine_config(cfg)
    if simulates_time(config.executor):
        raise ValueError(f"executor={config.executor} runs on simulated time; a server answers clients in wall time: "
                         f"leave executor out (the real forward pass)")
    if cfg.get("clock", "auto") not in ("auto", "wall"):
        raise ValueError(f"clock={cfg.get('clock')!r}: a server runs on the wall clock; use clock=auto or clock=wall")
    if cfg.get("cluster") is not None:
        raise ValueError("a server runs one engine: leave +cluster out (replicas behind a router are simulated only)")
    return settings, config


def listen(settings: ServerSettings) -> socket.socket:
    """The bound, listening socket (port 0: a free one); ValueError, one line, when the address is taken."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as exc:
        sock.close()
        # A taken or privileged port is the port's fault; an address that does not resolve or is not this
        # machine's is the host's.
        advice = "pick another with server.port=N" if exc.errno in (errno.EADDRINUSE, errno.EACCES) else \
            "give one of this machine's addresses with server.host=ADDRESS"
        raise ValueError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}; {advice}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class LabServer:
    """Built from a composed config (``check_config`` first, then the engine, warmed up; the socket is bound before
    the engine is built). ``serve`` blocks until SIGINT/SIGTERM or ``shutdown``, then writes the run's files."""

    def __init__(self, cfg: DictConfig, run_dir: str | Path) -> None:
        settings, config = check_config(cfg)
        self.settings = settings
        self.run_dir = Path(run_dir)
        clear_run_dir(cfg, run_dir)
        slo = SLO(**OmegaConf.to_container(cfg.slo, resolve=True)) if cfg.get("slo") else SLO()
        self.socket = listen(settings)
        try:
            self.engine = build_cluster(cfg, config, WallClock()).engines[0]
            warm_up(self.engine, cfg.get("warmup", 1))
        except BaseException:
            self.socket.close()
            raise
        self.model_name = settings.served_model_name or config.model
        resolved = OmegaConf.to_container(cfg, resolve=True)
        meta = {"policy": config.policy, "allocator": config.allocator, "backend": config.backend,
                "preparer": config.preparer, "executor": config.executor, "model": config.model,
                "workload": "served", "rate": None, "enable_prefix_caching": config.enable_prefix_caching,
                "preemption_mode": getattr(self.engine.policy, "preemption_mode", None),
                "run_dir": str(self.run_dir), "url": self.url}
        self.run = ServedRun(self.engine, self.run_dir, meta, slo, keep_timeline=bool(cfg.get("plots", True)))
        self.run.recorder.write_config(resolved)
        self.metrics = ServerMetrics(self.model_name, self.engine)
        self.engine.step_callbacks.append(self.metrics)
        self.loop = EngineLoop(self.engine, on_output=self._on_output)
        self.serving = Serving(self.loop, self.model_name)
        self.app = build_app(self.serving, self.metrics, settings.api_key)
        self.app.router.lifespan_context = self._lifespan
        self.plots = bool(cfg.get("plots", True))
        self._uvicorn = _Uvicorn(uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="on",
                                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S), self.loop)
        self.ready = threading.Event()
        self.summary: dict[str, Any] | None = None

    @property
    def port(self) -> int:
        return self.socket.getsockname()[1]

    @property
    def url(self) -> str:
        host = self.settings.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    def _on_output(self, out: RequestOutput) -> None:
        """Engine thread: record the output, count its tokens, and a finished request's latencies."""
        self.metrics.count_generated(sum(len(c.token_ids) for c in out.outputs))
        record = self.run.on_output(out)
        if record is not None:
            reason = out.outputs[0].finish_reason if out.outputs else None
            self.metrics.observe_finished(record, reason or "abort")

    @asynccontextmanager
    async def _lifespan(self, _: Any):
        self.loop.start(asyncio.get_running_loop())
        self.ready.set()
        try:
            yield
        finally:
            await asyncio.to_thread(self.loop.stop)

    def serve(self) -> dict[str, Any]:
        """Serve until stopped; then abort what is in flight, write ``summary.json`` (and the plots) and return it.
        In the main thread, SIGINT and SIGTERM stop it (a second SIGINT skips waiting for connections)."""
        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, _ignore) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            log.info("serving %s on %s (run dir %s)", self.model_name, self.url, self.run_dir)
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self.socket.close()
            self.loop.stop()  # already stopped unless the shutdown was forced
            self.metrics.update_queues_if_idle()
            self.summary = self.run.finish("completed" if self.loop.error is None else "failed")
            if self.plots:
                self._draw_plots()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self.summary

    def shutdown(self) -> None:
        """Stop ``serve`` from another thread, as SIGTERM does."""
        self._uvicorn.stop()

    def _draw_plots(self) -> None:
        from framework.harness import plots

        try:
            if any(r.completed for r in self.run.records):
                plots.latency_cdfs(self.run.records, self.run_dir / "latency_cdf.png")
            steps = self.run.recorder.timeline()
            if len(steps.get("time_s", ())):
                plots.timeline(steps, self.run_dir / "timeline.png")
        except Exception as exc:  # the figures are extras: the run's files are written already
            log.warning("could not draw the plots: %s", exc)


def _ignore(signum: int, frame: Any) -> None:
    """While serving, uvicorn takes SIGINT and SIGTERM, and raises them again once it has stopped: by then the
    server is shutting down as asked, so they must not interrupt the summary being written."""


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, which on a stop signal first aborts the requests in flight (their streams end with
    ``finish_reason`` abort), so that the open connections close instead of running to their end."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop) -> None:
        super().__init__(config)
        self.engine_loop = engine_loop
        self._asyncio_loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._asyncio_loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        self.engine_loop.abort_all()

    def stop(self) -> None:
        self.should_exit = True
        self.engine_loop.abort_all()
