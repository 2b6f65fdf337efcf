"""The tasks: what a source becomes (named entry points over one set of weights) and how they are
verified. Everything else a conversion does is the same for every task (pipeline.py), and every
reader of an artifact (Artifact, the gate, the runtime, the servers) works per entry point.

  forward          the model's forward as one entry point, "serving_default" (tasks/forward.py)
  text-generation  a causal LM's prefill and decode over a KV cache, an encoder-decoder's encode and
                   decode (tasks/generation.py)
"""

from tpuexport.errors import TpuExportError
from tpuexport.tasks.conversion import Conversion, ConversionOptions, StageClock
from tpuexport.tasks.forward import ForwardTask
from tpuexport.tasks.generation import TextGenerationTask
from tpuexport.tasks.spec import EntryPointSpec, ProgramSpec, Task, Verified

TASKS: dict[str, Task] = {task.name: task for task in (ForwardTask(), TextGenerationTask())}


def task_named(name: str) -> Task:
    """The registry's task of that name.

    Raises:
      TpuExportError: no such task.
    """
    if name not in TASKS:
        raise TpuExportError(f"unknown task {name!r}; use one of {', '.join(TASKS)}")
    return TASKS[name]


__all__ = ["TASKS", "Conversion", "ConversionOptions", "EntryPointSpec", "ProgramSpec", "StageClock", "Task", "Verified", "task_named"]
