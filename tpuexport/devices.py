"""The JAX devices each role of tpuexport runs on, without overriding the process's own choice.

Importing tpuexport leaves JAX's configuration alone (its platform, default device and flags).
Two roles use JAX inside a user's process:

- converting (and the other runs of the lowered program: `Artifact.run`/`generate`/`stream`, the
  gate's golden replay) computes on the host CPU, whatever platform the process chose:
  `on_host_cpu()` makes the first CPU device JAX's default device while they run. TPU executables
  are compiled in child processes of their own (compile/aot.py), never on the process's TPU;
- the runtime (`tpuexport.runner`, `serve`) runs on the devices JAX sees (`runtime_devices()`),
  so a TPU host's TPU, or whatever JAX_PLATFORMS names.

Both start JAX's backends through `start_backends()`. When nothing chose a platform yet
(JAX_PLATFORMS unset, no `jax.config.update("jax_platforms", ...)`, no backend started) and the
machine has no TPU chip on its PCI bus, JAX would try libtpu first and fall back to the CPU
after it fails (measured here with libtpu 0.0.42.1: 1.5 s and four lines of libtpu errors about
TPU_ACCELERATOR_TYPE and TPU_WORKER_HOSTNAMES on stderr). It picks the CPU at once instead: the
same devices JAX ends up with, without the failing probe. With a TPU chip present, or with a
platform already chosen, JAX decides as usual.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import jax
# Private to JAX but the same checks JAX itself makes before starting libtpu (jax/_src/cloud_tpu_init.py).
from jax._src import hardware_utils, xla_bridge

from tpuexport.errors import TpuExportError


def platform_chosen() -> str | None:
    """The platforms this process asked JAX for (JAX_PLATFORMS or jax.config), None if none."""
    return jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS") or None


def tpu_chips_on_this_machine() -> int:
    """TPU chips on this machine's PCI bus, as JAX counts them before loading libtpu."""
    return hardware_utils.num_available_tpu_chips_and_device_id()[0]


def start_backends() -> None:
    """Starts JAX's backends, choosing the CPU only where JAX would end up there anyway (see the
    module docstring): nothing chose a platform and no TPU chip is attached.

    Raises:
      TpuExportError: the platform the process chose does not start here (JAX_PLATFORMS=tpu on a
        machine without a TPU), in one line.
    """
    if not xla_bridge.backends_are_initialized() and platform_chosen() is None and tpu_chips_on_this_machine() == 0:
        jax.config.update("jax_platforms", "cpu")
    try:
        jax.devices()
    except RuntimeError as error:
        raise TpuExportError(f"JAX could not start the platform this process chose (JAX_PLATFORMS={platform_chosen()}): "
                             f"{' '.join(str(error).split())}") from None


def host_cpu_device() -> jax.Device:
    """The first CPU device, where conversions and the lowered program's runs compute.

    Raises:
      TpuExportError: the process left JAX's CPU backend out (JAX_PLATFORMS=tpu).
    """
    start_backends()
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        raise TpuExportError(f"converting and verifying run on JAX's CPU backend, which this process left out "
                             f"(JAX_PLATFORMS={platform_chosen()}); set JAX_PLATFORMS={platform_chosen()},cpu") from None


@contextlib.contextmanager
def on_host_cpu() -> Iterator[jax.Device]:
    """Within the block, arrays and computations without a device of their own go to the host CPU
    (jax.default_device; the process's setting comes back on leaving)."""
    device = host_cpu_device()
    with jax.default_device(device):
        yield device


def runs_on_host_cpu(function):
    """`function` run within `on_host_cpu()` (for a function that returns; a generator's steps take
    `steps_on_host_cpu`, since a context held across a yield would leak into the caller)."""
    @functools.wraps(function)
    def call(*args, **kwargs):
        with on_host_cpu():
            return function(*args, **kwargs)

    return call


def steps_on_host_cpu(steps: Iterator) -> Iterator:
    """The items of `steps`, each computed within `on_host_cpu()`."""
    while True:
        with on_host_cpu():
            try:
                item = next(steps)
            except StopIteration:
                return
        yield item


def runtime_devices() -> list[jax.Device]:
    """The devices the runtime runs on: the default backend's, as JAX_PLATFORMS or the hardware decide."""
    start_backends()
    return jax.devices()
