"""Turn a notebook's job into bytes a rank can run: cloudpickle, the learner's own modules by value.

Functions defined in a notebook cell are pickled by value (a rank has no notebook to look them up
in). So are modules under the working directory (not installed packages, not ddpkit): workers
persist, and a module they imported by reference would stay as it was after the learner edits it.
They are registered with cloudpickle for the one ``dumps`` only (its registry is process-wide).
"""
from __future__ import annotations

import os
import sys
import sysconfig

import cloudpickle


class JobPickler:
    """Pickles jobs for one cluster; remembers which imported modules are the learner's own."""

    def __init__(self):
        # (working directory, {module name: is it the learner's?}): deciding means a realpath
        # per module, so verdicts are cached, per working directory.
        self._verdicts: tuple[str, dict] = ("", {})

    def dumps(self, fn, args, kwargs, runner=None) -> bytes:
        """cloudpickle ``(fn, args, kwargs)``, the learner's own modules by value. ``runner``:
        ``(function, extra args)`` that the rank calls as ``function(fn, args, kwargs, *extra)``
        instead (the recording switch wraps a job this way; ``kwargs`` still all go to ``fn``)."""
        ours = [m for m in self.learner_modules()
                if m.__name__ not in cloudpickle.list_registry_pickle_by_value()]
        for m in ours:
            cloudpickle.register_pickle_by_value(m)
        job = (fn, args, kwargs) if runner is None else (runner[0], (fn, args, kwargs, *runner[1]), {})
        try:
            return cloudpickle.dumps(job)
        except Exception as exc:
            name = getattr(fn, "__qualname__", type(fn).__name__)
            parts = [(f"the function {name!r}", fn)]
            parts += [(f"argument {i} (a {type(a).__name__})", a) for i, a in enumerate(args)]
            parts += [(f"keyword argument {k!r} (a {type(v).__name__})", v) for k, v in kwargs.items()]
            what = next((label for label, obj in parts if not _picklable(obj)),
                        f"the function {name!r} with its arguments")
            raise TypeError(
                f"cannot send {what} to the ranks: cloudpickle could not pickle it "
                f"({type(exc).__name__}: {exc}). A job and its arguments cannot capture open files, "
                "locks, sockets, generators or the Cluster itself; create those inside the job."
            ) from exc
        finally:
            for m in ours:
                cloudpickle.unregister_pickle_by_value(m)

    def learner_modules(self) -> list:
        """Imported modules that are the learner's own files, to be pickled by value."""
        root = os.path.join(os.path.realpath(os.getcwd()), "")
        if self._verdicts[0] != root:
            self._verdicts = (root, {})
        verdicts = self._verdicts[1]
        paths = sysconfig.get_paths()
        installed = tuple(os.path.join(os.path.realpath(p), "") for p in
                          {sys.prefix, sys.base_prefix, sys.exec_prefix, paths["stdlib"], paths["purelib"]})
        out = []
        for name, module in list(sys.modules.items()):
            if name not in verdicts:
                verdicts[name] = _is_learner_module(name, module, root, installed)
            if verdicts[name]:
                out.append(module)
        return out


def _is_learner_module(name: str, module, root: str, installed: tuple[str, ...]) -> bool:
    """Is ``module`` the learner's own code (a .py file under ``root``, not installed, not ddpkit)?"""
    path = getattr(module, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py") or not os.path.isabs(path):
        return False  # built in, an extension, or a pseudo-module such as torch.ops ("_ops.py")
    if name.split(".")[0] in ("ddpkit", "__main__"):
        return False
    path = os.path.realpath(path)
    if not path.startswith(root) or path.startswith(installed):
        return False
    return not {"site-packages", "dist-packages"} & set(path.split(os.sep))


def _picklable(obj) -> bool:
    try:
        cloudpickle.dumps(obj)
    except Exception:
        return False
    return True
