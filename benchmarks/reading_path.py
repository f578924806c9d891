"""The reading path: how many lines a learner reads to follow naive's, bucketed's and overlapped's
step, in the files they open (the strategy file, the core it builds on, the buckets), against the
budget the package keeps (``tests/test_package_face.py`` asserts it).

    python benchmarks/reading_path.py

Not on the path, on purpose: ``ddp_compat.py`` (torch DDP's arguments, buffers, Join, comm-hook
registration), ``common.py`` (checks, timing, clipping), ``torch_internals.py``: a strategy file
names what it calls there in a comment, and its step reads without opening them.
"""
from __future__ import annotations

import pathlib

STRATEGIES = pathlib.Path(__file__).resolve().parents[1] / "ddpkit" / "strategies"
PATHS = {  # what each strategy's step reads, in the order a learner opens it
    "naive": ("naive.py", "ddp_module.py"),
    "bucketed": ("bucketed.py", "ddp_module.py", "buckets.py"),
    "overlapped": ("overlapped.py", "bucketed.py", "ddp_module.py", "buckets.py"),
}
BUDGET = 600  # lines, the three paths together (every file counted once; docstrings and recorder calls in)


def lines(name: str) -> int:
    return len((STRATEGIES / name).read_text().splitlines())


def together() -> tuple[list[str], int]:
    """(every file on the three paths, once; their lines together)."""
    files = sorted({f for path in PATHS.values() for f in path})
    return files, sum(lines(f) for f in files)


if __name__ == "__main__":
    for strategy, path in PATHS.items():
        print(f"{strategy:>10}: {sum(lines(f) for f in path):4d} lines  ({', '.join(f'{f} {lines(f)}' for f in path)})")
    files, total = together()
    print(f"  together: {total:4d} lines in {len(files)} files (budget {BUDGET})")
