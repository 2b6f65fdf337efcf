"""`tpuexport serve`: the REST and gRPC servers over the models' runtimes, started and stopped together;
the REST port answers TF Serving's REST API and OpenAI's (serve/openai.py).

Start-up: every artifact is opened (executables loaded without compiling, weights placed), then
the gRPC server and the REST server start; /readyz answers 200 from then on. On SIGINT or SIGTERM
shutdown is graceful: /readyz turns 503, uvicorn stops accepting connections and finishes the
requests in flight, gRPC gets the same grace, then each model's batcher runs what it has queued.

A multi-process run (`cluster`, runtime/processes.py) serves one artifact: process 0 serves as above
and its runner's calls run in every process; the other processes open the runner, run those calls
until process 0 stops, and serve nothing themselves.
"""

from __future__ import annotations

import contextlib
import pathlib
import signal
import socket
import sys
import threading
from typing import Callable

import uvicorn

from tpuexport.errors import TpuExportError
from tpuexport.runtime.processes import Cluster
from tpuexport.serve.grpc_service import start_grpc_server
from tpuexport.serve.metrics import Metrics
from tpuexport.serve.models import ModelRepository
from tpuexport.serve.openai import openai_routes
from tpuexport.serve.rest import DEFAULT_MAX_BODY_BYTES, create_app

# Seconds in-flight requests get to finish at shutdown.
SHUTDOWN_GRACE_SECONDS = 30


def serve(
    artifacts: list[pathlib.Path],
    host: str = "127.0.0.1",
    port: int = 8501,
    grpc_port: int | None = 8500,
    batch_timeout_ms: float = 2.0,
    allow_recompile: bool = False,
    target: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    announce: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    cluster: Cluster | None = None,
    prefix_caching: bool = True,
) -> None:
    """Serves artifacts until SIGINT or SIGTERM (see the module docstring).

    Args:
      artifacts: artifact directories (several models, or several versions of one).
      host: the address both servers listen on.
      port: the REST port (0 picks a free one, announced).
      grpc_port: the gRPC port, None for no gRPC server.
      batch_timeout_ms: how long a request waits for others to batch with (0: no batching).
      allow_recompile: compile the StableHLO where an artifact's compile key differs from the host.
      target: the target to serve from every artifact, None to match the local devices.
      max_body_bytes: larger REST request bodies are refused.
      announce: prints progress lines (models loaded, where the servers listen).
      cluster: this process's place in a multi-process run (see the module docstring), None for one process.
      prefix_caching: paged artifacts share the KV pages of identical prompt prefixes between requests.
    Raises:
      TpuExportError: no artifact, one that cannot be served here, a port that cannot be bound, or
        several artifacts in a multi-process run.
    """
    if not artifacts:
        raise TpuExportError("no artifact to serve; pass one or more artifact directories")
    if batch_timeout_ms < 0:
        raise TpuExportError(f"--batch-timeout-ms {batch_timeout_ms:g} is negative; give 0 (no batching) or more")
    if cluster is not None and len(artifacts) > 1:
        raise TpuExportError(f"a multi-process run serves one artifact, {len(artifacts)} given; start one run per artifact")
    metrics = Metrics()
    repository = ModelRepository(list(artifacts), batch_timeout_ms / 1000, metrics, allow_recompile, target, cluster, prefix_caching)
    for model in repository:
        announce(f"model {model.name} version {model.version}: {model.runner.describe()}")
    follower = next((model.runner for model in repository if model.runner.mirror and not model.runner.mirror.leader), None)
    if follower is not None:
        announce(f"process {follower.mirror.index} runs process 0's steps")
        try:
            announce(f"stopped after {follower.follow()} steps (process 0 stopped)")
        finally:
            repository.close()
        return
    state = {"ready": False}
    grpc_server = None
    try:
        if grpc_port is not None:
            grpc_server, bound = start_grpc_server(repository, metrics, host, grpc_port)
            announce(f"gRPC PredictionService on {host}:{bound}")
        try:
            # Bound here, not by uvicorn (which exits the process on a busy port): one clear error.
            listener = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        except OSError as error:
            raise TpuExportError(f"cannot listen for REST on {host}:{port} ({error.strerror}); choose another --port") from None
        app = create_app(repository, metrics, state, max_body_bytes, tuple(openai_routes(repository, metrics, max_body_bytes)))
        config = uvicorn.Config(app, host=host, port=listener.getsockname()[1],
                                log_level="warning", access_log=False, timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS, lifespan="off")
        _Server(config, state, announce).run(sockets=[listener])
    finally:
        state["ready"] = False
        if grpc_server is not None:
            grpc_server.stop(SHUTDOWN_GRACE_SECONDS).wait()
        repository.close()
        announce("stopped")


class _Server(uvicorn.Server):
    """uvicorn's server, marking the models ready once it listens and not ready once it stops."""

    def __init__(self, config: uvicorn.Config, state: dict, announce: Callable[[str], None]):
        super().__init__(config)
        self.state = state
        self.announce = announce

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.state["ready"] = True
            self.announce(f"REST API on http://{self.config.host}:{self.config.port} (ready)")

    async def shutdown(self, sockets=None) -> None:
        self.state["ready"] = False
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT/SIGTERM start the graceful shutdown. Unlike uvicorn's own, the signal is not raised
        again afterwards: gRPC and the batchers still have to stop, and the exit is a normal one."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, lambda number, frame: setattr(self, "should_exit", True))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
