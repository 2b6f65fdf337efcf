"""One artifact run by several processes, one per host of a multi-host slice (multi-controller SPMD).

Every process joins jax.distributed (`join`), loads the same executables and places its own weight
shards (runner.py). Process 0, the leader, takes the requests; before each executable call it
publishes the call (`Step`: entry point, bucket, the host arrays of its inputs, and for inputs that
are device arrays a reference to the earlier output they are) in jax.distributed's key-value store,
and waits for every follower to take it. Followers (`follow`) run the same calls in the same order,
so the executables' collectives meet. Only host arrays travel; the KV cache and logits that stay on
the devices are each process's own shards, named by the step that made them.

A follower that stops taking steps fails the leader's step within `Cluster.timeout` seconds; one
that dies inside a step fails the collectives at once (gloo reports the closed connection); one that
hangs inside a step (stopped, or its host silent) leaves the others' calls blocked in the step's
collectives, which every process therefore waits for on a thread of its own, for at most the same
timeout (`Mirror.run`). Either way the runner is lost (`ProcessLost`: the server answers 503 and /readyz turns 503); the processes
must be restarted together. jax.distributed runs with recoverability on, so that a follower's death
does not abort the leader (without it, the coordination service terminates every process).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import json
import os
import queue
import sys
import threading
import time
import weakref

import jax
import ml_dtypes
import numpy as np
from jax._src import distributed as jax_distributed  # the KV store of jax.distributed's client
from jax._src import xla_bridge

from tpuexport.devices import platform_chosen, tpu_chips_on_this_machine
from tpuexport.errors import EXIT_BAD_INPUT, TpuExportError

DEFAULT_TIMEOUT_SECONDS = 60.0
# What a follower's disconnection from the coordinator takes at most, measured in ms on loopback.
LEAVE_GRACE_SECONDS = 0.5
# Followers wait this long for the next step before asking again (the leader may be idle for hours).
_IDLE_POLL_MS = 60_000
_runner_numbers = itertools.count()
# Set once a follower is lost: the leader then leaves without waiting for the followers.
_lost_followers = False
# Set once a call was left hung inside its collectives (Mirror.run). Such a process exits at once, as
# a lost run's process does (exit 2): leaving jax.distributed in order would end the hung call, whose
# thread would then abort the exiting interpreter.
_hung_call = False


class ProcessLost(TpuExportError):
    """Another process of a multi-process run stopped or hangs: the run cannot go on (HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """This process's place among the processes of a multi-host run.

    Attributes:
      coordinator: HOST:PORT where process 0 serves jax.distributed's coordinator; None to let JAX
        find it from a Cloud TPU VM's metadata (jax.distributed.initialize() with no arguments).
      processes: how many processes run (hosts); None with coordinator None.
      process_id: this process's index, 0 (the leader) to processes - 1.
      timeout: seconds to wait for the coordinator at start, for every follower to take each step and for each step to end.
    """

    coordinator: str | None
    processes: int | None
    process_id: int | None
    timeout: float = DEFAULT_TIMEOUT_SECONDS


def join(cluster: Cluster) -> None:
    """Joins jax.distributed as `cluster` says, before any JAX backend starts, and checks that every
    process was started with the same process count.

    Raises:
      TpuExportError: a process id out of range, a coordinator without a process count (or the
        reverse), JAX backends already started, an unreachable coordinator, or processes started
        with different counts; one line each.
    """
    if jax_distributed.global_state.client is not None:
        return
    if (cluster.coordinator is None) != (cluster.processes is None) or (cluster.processes is None) != (cluster.process_id is None):
        raise TpuExportError("give --coordinator HOST:PORT, --num-processes N and --process-id I together (or none of them "
                             "on a Cloud TPU VM, whose metadata names them)")
    if cluster.processes is not None and not 0 <= cluster.process_id < cluster.processes:
        raise TpuExportError(f"--process-id {cluster.process_id} is out of range for --num-processes {cluster.processes}; "
                             f"give 0 (the leader) to {cluster.processes - 1}")
    if cluster.coordinator is not None and not cluster.coordinator.rpartition(":")[2].isdigit():
        raise TpuExportError(f"--coordinator {cluster.coordinator!r} is not HOST:PORT; give process 0's address, e.g. 10.0.0.2:8476")
    if xla_bridge.backends_are_initialized():
        raise TpuExportError("JAX's devices were started before joining the other processes; open the runner (with its "
                             "coordinator) before any JAX computation in this process")
    if platform_chosen() in (None, "cpu") and tpu_chips_on_this_machine() == 0:
        # CPU devices of several processes: their collectives go over gloo (TCP).
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    timeout = max(1, round(cluster.timeout))
    try:
        jax.distributed.initialize(cluster.coordinator, cluster.processes, cluster.process_id, initialization_timeout=timeout)
    except (RuntimeError, ValueError) as error:  # JaxRuntimeError is a RuntimeError
        where = f"the coordinator at {cluster.coordinator}" if cluster.coordinator else "the Cloud TPU coordinator"
        raise TpuExportError(f"could not join {where} within {timeout} s ({' '.join(str(error).split())[:200]}); start process 0 "
                             "first and give every process the same --coordinator and --num-processes") from None
    # Runs before jax's own shutdown at exit (registered when jax was imported, atexit runs the last first).
    atexit.register(leave, cluster.timeout)
    _check_counts(jax.process_index(), jax_distributed.global_state.num_processes, cluster.timeout)


def leave(timeout: float) -> None:
    """Leaves jax.distributed in order. The leader's coordinator goes with the leader, and a follower
    whose disconnection finds no coordinator is aborted by jax (a stack trace instead of its one
    line): so a follower says it is leaving and disconnects, and the leader waits (up to `timeout`
    seconds, not at all once a follower was lost) for every follower's word, plus LEAVE_GRACE_SECONDS
    for the disconnections themselves, before it leaves."""
    state = jax_distributed.global_state
    if state.client is None:
        return
    if _hung_call:
        _exit_now()
    if state.process_id == 0:
        deadline = time.monotonic() + (0 if _lost_followers else timeout)
        for follower in range(1, state.num_processes):
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                break
            with contextlib.suppress(RuntimeError):  # it did not say: it is gone or hangs
                state.client.blocking_key_value_get(f"tpuexport/leaving/{follower}", remaining_ms)
        if not _lost_followers:
            time.sleep(LEAVE_GRACE_SECONDS)
    else:
        try:
            state.client.key_value_set(f"tpuexport/leaving/{state.process_id}", "1")
        except RuntimeError:
            # The leader and its coordinator are gone: disconnecting would abort this process, which
            # is failing anyway (its error line is printed), so it exits at once.
            _exit_now()
    jax.distributed.shutdown()


def _exit_now() -> None:
    """Exits a lost run's process (exit 2) without leaving jax.distributed, its lines printed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_BAD_INPUT)


def _check_counts(index: int, processes: int, timeout: float) -> None:
    """Every process publishes its process count and reads the others': a mismatch is one line."""
    client = jax_distributed.global_state.client
    client.key_value_set(f"tpuexport/processes/{index}", str(processes))
    for other in range(processes):
        try:
            theirs = int(client.blocking_key_value_get(f"tpuexport/processes/{other}", int(timeout * 1000)))
        except RuntimeError:
            raise TpuExportError(f"process {other} did not join within {timeout:g} s; start all {processes} processes with the same "
                                 "--coordinator and --num-processes") from None
        if theirs != processes:
            raise TpuExportError(f"process {other} was started with --num-processes {theirs}, this process (process {index}) with "
                                 f"{processes}; start every process with the same count")


def device_order_difference(recorded_ids: list[int], recorded_processes: list[int], devices: list) -> str:
    """What differs between the devices a slice's executables were compiled over and this run's.

    Args:
      recorded_ids: the manifest's device_ids (mesh order).
      recorded_processes: the manifest's device_processes (the process of each; [] if not recorded).
      devices: every device of the run (all processes').
    Returns:
      "" when every compiled device exists here in the same process, else one clause naming the
      first difference.
    """
    here = {device.id: device for device in devices}
    processes = len({device.process_index for device in devices})
    wanted = len(set(recorded_processes)) or 1
    if recorded_processes and wanted != processes:
        return f"it was compiled for {wanted} process(es) (hosts), this run has {processes}"
    for position, device_id in enumerate(recorded_ids):
        if device_id not in here:
            return (f"mesh position {position} is device {device_id}, which this run lacks (its devices are "
                    f"{sorted(here)[:16]}{' ...' if len(here) > 16 else ''})")
        if recorded_processes and here[device_id].process_index != recorded_processes[position]:
            return (f"mesh position {position}, device {device_id}, was in process {recorded_processes[position]} at compile time, "
                    f"is in process {here[device_id].process_index} here")
    return ""


@dataclasses.dataclass(frozen=True)
class Step:
    """One executable call, as the leader publishes it to the followers.

    Attributes:
      entry_point, bucket: which executable.
      sizes: the request's dim sizes (PreparedRequest.sizes).
      on_device: whether the outputs stay on the devices.
      inputs: per input, ("array", host array) or ("ref", (step number, output name)): an output an
        earlier step left on the devices.
      released: references the leader no longer holds (the followers drop theirs).
    """

    entry_point: str
    bucket: str
    sizes: dict
    on_device: bool
    inputs: tuple
    released: tuple = ()

    def encode(self) -> bytes:
        """The step as bytes: a JSON header's length (8 bytes), the header, the arrays' raw bytes."""
        header, blobs = [], []
        for kind, value in self.inputs:
            if kind == "ref":
                header.append({"ref": list(value)})
            else:
                array = np.ascontiguousarray(value)
                header.append({"dtype": array.dtype.name, "shape": list(array.shape), "bytes": array.nbytes})
                blobs.append(array.tobytes())
        text = json.dumps({"entry_point": self.entry_point, "bucket": self.bucket, "sizes": self.sizes, "on_device": self.on_device,
                           "inputs": header, "released": [list(ref) for ref in self.released]}).encode()
        return len(text).to_bytes(8, "little") + text + b"".join(blobs)

    @classmethod
    def decode(cls, data: bytes) -> "Step":
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + length])
        offset, inputs = 8 + length, []
        for item in header["inputs"]:
            if "ref" in item:
                inputs.append(("ref", tuple(item["ref"])))
                continue
            dtype = np.dtype(getattr(ml_dtypes, item["dtype"], item["dtype"]))
            inputs.append(("array", np.frombuffer(data, dtype, count=item["bytes"] // dtype.itemsize, offset=offset).reshape(item["shape"])))
            offset += item["bytes"]
        return cls(header["entry_point"], header["bucket"], header["sizes"], header["on_device"], tuple(inputs),
                   tuple(tuple(ref) for ref in header["released"]))


class Mirror:
    """The leader's or a follower's side of the step protocol for one runner (see the module docstring).

    Attributes:
      lost: why the run cannot go on (a follower stopped, hangs or the collectives failed), or None.
    """

    def __init__(self, timeout: float):
        self.client = jax_distributed.global_state.client
        self.index, self.processes = jax.process_index(), jax.process_count()
        self.timeout_ms = int(timeout * 1000)
        self.prefix = f"tpuexport/runner{next(_runner_numbers)}"
        self.lock = threading.RLock()  # the leader's step and its executable call, in one order
        self.step = 0
        self.lost: str | None = None
        self._refs: dict[int, tuple[int, str]] = {}  # leader: id(device array) -> (step, output name)
        self._released: list[tuple[int, str]] = []
        self._arrays: dict[tuple[int, str], jax.Array] = {}  # follower: (step, output name) -> its own array
        self._calls: queue.SimpleQueue | None = None  # run()'s thread's work, started with the first call

    @property
    def leader(self) -> bool:
        return self.index == 0

    def publish(self, step: Step) -> int:
        """Leader: publishes the next step and waits until every follower has taken it.

        Returns:
          The step's number.
        Raises:
          ProcessLost: the run is lost, or a follower did not take the step within the timeout.
        """
        if self.lost:
            raise ProcessLost(self.lost)
        self.step += 1
        released, self._released = tuple(self._released), []
        self.client.key_value_set_bytes(f"{self.prefix}/step/{self.step}", dataclasses.replace(step, released=released).encode())
        for follower in range(1, self.processes):
            try:
                self.client.blocking_key_value_get(f"{self.prefix}/took/{self.step}/{follower}", self.timeout_ms)
            except RuntimeError:
                raise self.lose(f"process {follower} did not take step {self.step} within {self.timeout_ms / 1000:g} s (it stopped "
                                "or hangs)") from None
        self.client.key_value_delete(f"{self.prefix}/step/{self.step}")
        for follower in range(1, self.processes):
            self.client.key_value_delete(f"{self.prefix}/took/{self.step}/{follower}")
        return self.step

    def run(self, call):
        """`call()` (an executable call, waited for) on this mirror's own thread, waited for at most the
        timeout. A process that hangs inside a step's collectives leaves every other process's call
        blocked in them; the call cannot be cancelled, so it is left on its thread and the run is lost,
        while the caller (a server's request) gets ProcessLost.

        Returns:
          What `call` returns (its exception is raised here).
        Raises:
          ProcessLost: the call did not end within the timeout.
        """
        if self._calls is None:
            self._calls = queue.SimpleQueue()
            threading.Thread(target=self._run_calls, name="tpuexport-steps", daemon=True).start()
        done, outcome = threading.Event(), {}
        self._calls.put((call, done, outcome))
        if not done.wait(self.timeout_ms / 1000):
            global _hung_call
            _hung_call = True
            raise self.lose(f"step {self.step} did not end within {self.timeout_ms / 1000:g} s (a process hangs inside it)")
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def _run_calls(self) -> None:
        while True:
            call, done, outcome = self._calls.get()
            try:
                outcome["result"] = call()
            except BaseException as error:  # noqa: BLE001  (handed to the caller, who raises it)
                outcome["error"] = error
            done.set()

    def reference(self, array) -> tuple[int, str]:
        """Leader: the (step, output name) a device array input came from.

        Raises:
          TpuExportError: a device array this runner did not return (followers have no copy of it).
        """
        ref = self._refs.get(id(array))
        if ref is None:
            raise TpuExportError("a device array this runner did not make is an input of a multi-process run; the other processes "
                                 "cannot see it: pass it as a host (numpy) array")
        return ref

    def keep(self, step: int, outputs: dict) -> None:
        """Leader: remembers the outputs left on the devices, to name them in later steps."""
        for name, value in outputs.items():
            if isinstance(value, jax.Array):
                self._refs[id(value)] = (step, name)
                weakref.finalize(value, self._forget, id(value), (step, name))

    def _forget(self, key: int, ref: tuple[int, str]) -> None:
        if self._refs.get(key) == ref:
            del self._refs[key]
        self._released.append(ref)

    def lose(self, why: str) -> ProcessLost:
        """Marks the run lost; returns the error to raise."""
        global _lost_followers
        _lost_followers = _lost_followers or self.leader
        self.lost = (f"the multi-process run is lost: {why}; restart every process (the leader with --process-id 0 first)"
                     if not self.lost else self.lost)
        return ProcessLost(self.lost)

    def next_step(self) -> Step | None:
        """Follower: the leader's next step once it is published (None: the leader stopped), taken.

        Raises:
          ProcessLost: the leader (and the coordinator it runs) is gone.
        """
        key = f"{self.prefix}/step/{self.step + 1}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, _IDLE_POLL_MS)
                break
            except RuntimeError as error:
                if "DEADLINE_EXCEEDED" not in str(error):
                    raise self.lose(f"the leader (process 0) is gone ({' '.join(str(error).split())[:160]})") from None
        self.step += 1
        if data == b"stop":
            leave(self.timeout_ms / 1000)
            return None
        self.client.key_value_set(f"{self.prefix}/took/{self.step}/{self.index}", "1")
        step = Step.decode(data)
        for ref in step.released:
            self._arrays.pop(ref, None)
        return step

    def resolve(self, step: Step) -> list:
        """Follower: the step's inputs, references replaced by this process's own arrays."""
        return [self._arrays[tuple(value)] if kind == "ref" else value for kind, value in step.inputs]

    def hold(self, outputs: dict) -> None:
        """Follower: keeps the outputs the step left on the devices, under the leader's names."""
        for name, value in outputs.items():
            if isinstance(value, jax.Array):
                self._arrays[(self.step, name)] = value

    def stop(self) -> None:
        """Leader: tells the followers to stop and leaves jax.distributed after them (`leave`)."""
        with self.lock:
            if self.lost or not self.leader:
                return
            self.step += 1
            self.client.key_value_set_bytes(f"{self.prefix}/step/{self.step}", b"stop")
            self.lost = "the leader stopped"
        leave(self.timeout_ms / 1000)
