"""The course's exercises: each is a function that raises ``NotImplementedError`` until you write it.

Each module matches a notebook; every function's docstring states the task, the shapes and how
it is checked. The reference answers are in ``solutions/`` (same names): try first.

Check your work with the grader, from the repository root::

    DDPKIT_TARGET=exercises python -m pytest tests/test_exercises.py -k collectives

(pytest comes with the course: the README's set-up line installs it.) The run ends with one line
per exercise: *right*, *WRONG* (with a hint where the mistake is a known one), or *not written
yet* (a skip, not a failure).

In the notebooks, ``exercises.use("collectives", "ring_all_reduce")`` gives your function once
you have written it, and the reference solution while it is still a stub, so every notebook
runs from the first day; it prints which of the two it gives. It re-reads your file each time,
so an edit is picked up without restarting the kernel or the cluster.
"""
from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

TOPICS = ("collectives", "averaging", "buckets", "overlap", "sharding", "zero", "costs")


def is_stub(fn) -> bool:
    """True while ``fn``'s body is only its docstring and ``raise NotImplementedError(...)``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):  # no source (a builtin, a lambda made at run time): not a stub
        return False
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or body[0].exc is None:
        return False
    exc = body[0].exc
    name = exc.func if isinstance(exc, ast.Call) else exc
    return isinstance(name, ast.Name) and name.id == "NotImplementedError"


def exercise_functions(module) -> dict:
    """``{name: function}`` of the exercises defined in ``module`` (public functions, in file order)."""
    return {n: f for n, f in vars(module).items()
            if inspect.isfunction(f) and not n.startswith("_") and f.__module__ == module.__name__}


def use(topic: str, name: str, quiet: bool = False):
    """Your ``exercises.<topic>.<name>`` if you have written it, else the reference solution.

    Says which one it gives (unless ``quiet``). The module is reloaded from its file first and
    registered to be pickled *by value*, so a ``Cluster`` job that calls the function runs the
    code as it is in the file now, not an old copy a rank imported earlier.
    """
    import cloudpickle

    if topic not in TOPICS:
        raise ValueError(f"unknown exercise topic {topic!r}; valid: {', '.join(TOPICS)}")
    mine = importlib.reload(importlib.import_module(f"exercises.{topic}"))
    fn = getattr(mine, name)
    # short lines: a notebook's output wraps long ones mid-word
    check = f"  DDPKIT_TARGET=exercises python -m pytest tests/test_exercises.py -k {name}"
    if is_stub(fn):
        ref = importlib.reload(importlib.import_module(f"solutions.{topic}"))
        if not quiet:
            print(f"{name}: using the REFERENCE solution (solutions/{topic}.py):\n"
                  f"  yours in exercises/{topic}.py is not written yet.\n"
                  f"  Write it, then check it with\n{check}")
        fn, mine = getattr(ref, name), ref
    elif not quiet:
        print(f"{name}: using YOUR code from exercises/{topic}.py.\n  Check it with\n{check}")
    cloudpickle.register_pickle_by_value(mine)
    return fn
