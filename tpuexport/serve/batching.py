"""Dynamic batching: concurrent requests to one model joined into one execution.

Each served model version has one `Batcher` thread. A request waits at most `timeout` seconds
for others to join it; a batch closes earlier when it reaches the largest bucket's rows. Requests
join only when they differ in the batch dim alone (same entry point, same other dims); their rows
are concatenated, the runtime pads the whole to the smallest bucket that holds it, and each
request gets its own rows of the outputs back. A timeout of 0 runs every request on its own.
Entry points without a batch dim run one request at a time.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import numpy as np

from tpuexport.errors import TpuExportError
from tpuexport.runtime import PreparedRequest, Runner
from tpuexport.serve.metrics import Metrics

_STOP = object()


class ShuttingDown(TpuExportError):
    """The server is shutting down and takes no new requests."""


class Batcher:
    """Runs one model version's requests, batched (see the module docstring).

    Args:
      runner: the model's runtime.
      timeout: seconds a request waits for others (0: no batching).
      metrics: where executions are counted.
      labels: {"model", "version"} metric labels.
    """

    def __init__(self, runner: Runner, timeout: float, metrics: Metrics, labels: dict[str, str]):
        self.runner = runner
        self.timeout = timeout
        self.metrics = metrics
        self.labels = labels
        self.queue: queue.Queue = queue.Queue()
        self.closed = False
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name=f"batcher-{labels['model']}-{labels['version']}", daemon=True)
        self.thread.start()

    def submit(self, request: PreparedRequest) -> Future:
        """Queues a prepared request.

        Returns:
          A Future of its outputs ({name: array}).
        Raises:
          ShuttingDown: after `close`.
        """
        future: Future = Future()
        with self.lock:
            if self.closed:
                raise ShuttingDown("the server is shutting down; retry on another replica")
            self.queue.put((request, future))
        return future

    def close(self) -> None:
        """Stops taking requests, runs those already queued, and ends the thread."""
        with self.lock:
            self.closed = True
            self.queue.put(_STOP)
        self.thread.join()

    def _loop(self) -> None:
        carried = None
        while True:
            first = carried if carried is not None else self.queue.get()
            carried = None
            if first is _STOP:
                return
            batch = [first]
            request = first[0]
            batch_dim = request.entry.batch_dim
            if batch_dim and self.timeout > 0:
                carried = self._fill(batch, request)
            self._run(batch)

    def _fill(self, batch: list, first: PreparedRequest):
        """Adds queued requests that can join `first` until the rows fill its largest bucket or the
        timeout passes. Returns a request that could not join (to run next), or None."""
        entry = first.entry
        largest = max(bucket.sizes[entry.batch_dim] for bucket in entry.buckets if _same_other_dims(bucket.sizes, first))
        rows = first.rows
        deadline = time.monotonic() + self.timeout
        while rows < largest:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                item = self.queue.get(timeout=remaining)
            except queue.Empty:
                return None
            if item is _STOP:
                return item
            request = item[0]
            if request.entry is not entry or not _same_other_dims(request.sizes, first) or rows + request.rows > largest:
                return item
            batch.append(item)
            rows += request.rows
        return None

    def _run(self, batch: list) -> None:
        requests = [request for request, _ in batch]
        try:
            if len(requests) == 1:
                merged = requests[0]
            else:
                # The rows of every request, in order; the runtime picks the bucket for the total.
                arrays = [np.concatenate([request.arrays[index] for request in requests]) for index in range(len(requests[0].arrays))]
                merged = self.runner.prepare(arrays, requests[0].entry.name)
            execution = self.runner.execute(merged)
        except Exception as error:  # reported to each waiting request; the thread serves on
            for _, future in batch:
                future.set_exception(error)
            return
        self.metrics.batch_rows.labels(**self.labels).observe(execution.rows)
        self.metrics.bucket_hits.labels(**self.labels, bucket=execution.bucket.name).inc()
        self.metrics.rows.labels(**self.labels).inc(execution.rows)
        self.metrics.padded_rows.labels(**self.labels).inc(execution.padded_to - execution.rows)
        start = 0
        for request, future in batch:
            if request.entry.batch_dim:
                future.set_result({name: output[start:start + request.rows] for name, output in execution.outputs.items()})
            else:
                future.set_result(execution.outputs)
            start += request.rows


def _same_other_dims(sizes: dict[str, int], request: PreparedRequest) -> bool:
    """Whether `sizes` equal the request's in every dim but the batch dim."""
    batch_dim = request.entry.batch_dim
    return all(size == request.sizes[name] for name, size in sizes.items() if name != batch_dim)

