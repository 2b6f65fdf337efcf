"""Counting XLA compilations, so "nothing compiles at start" is measured, not assumed.

JAX records a duration event (jax.monitoring) for every backend compilation it runs: jit and AOT
`.compile()` alike, a persistent-cache hit included (it still asks the compiler). Loading a
serialized executable (serialize_executable.deserialize_and_load) and placing arrays record none.
The count is process-wide: a compilation another thread runs meanwhile counts too.
"""

from __future__ import annotations

import threading

from jax import monitoring

# The event JAX's dispatch records around each backend compile (jax/_src/dispatch.py BACKEND_COMPILE_EVENT).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompilationCounter:
    """A context manager counting the backend compilations JAX runs in this process within it.

    Attributes:
      count: compilations so far (final once the block has ended).
    """

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            with self._lock:
                self.count += 1

    def __enter__(self) -> "CompilationCounter":
        monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        monitoring.unregister_event_duration_listener(self._listen)
