"""PEP 562 for ddpkit's packages: names handed on from their homes, each imported on first use."""
import importlib
import importlib.util


def lazy_names(namespace: dict, homes: dict, submodules: bool = False):
    """PEP 562 for a package (``namespace``: its globals) that hands on each name of ``homes`` from
    its home module (absolute, or relative to the package: ".naive"), imported on first use; with
    ``submodules`` an unknown name may be a submodule, imported too. Its (``__getattr__``, ``__dir__``)."""
    package = namespace["__name__"]

    def __getattr__(name: str):
        if name in homes:
            namespace[name] = getattr(importlib.import_module(homes[name], package), name)  # looked up once
            return namespace[name]
        if submodules and not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, lambda: sorted(set(namespace) | set(homes))
