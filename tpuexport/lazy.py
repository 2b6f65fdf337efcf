"""Package namespaces whose public names are imported from their modules on first use (PEP 562).

Importing a package, or one module of it, then imports nothing else: `tpuexport` imports no torch,
jax or TensorFlow, and the runtime and servers, which take a few names from the stages, never import
torch (about 2 s and 400 MB at every `serve` or `generate` start).
"""

from __future__ import annotations

import importlib


def lazy_exports(package: str, modules: dict[str, list[str]]):
    """The `__getattr__`, `__dir__` and `__all__` of `package`.

    Args:
      package: the package's `__name__`.
      modules: {module, relative to the package (e.g. "generation" or "lower.sampling"): the public
        names it defines}; "name=attribute" exports the module's `attribute` as `name`.
    """
    where: dict[str, tuple[str, str]] = {}
    for module, names in modules.items():
        for entry in names:
            name, _, attribute = entry.partition("=")
            where[name] = (f"{package}.{module}", attribute or name)
    namespace = importlib.import_module(package)

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, attribute = where[name]
        value = getattr(importlib.import_module(module), attribute)
        setattr(namespace, name, value)  # later lookups skip __getattr__
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(namespace), *where})

    return __getattr__, __dir__, sorted(where)
