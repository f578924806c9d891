#!/usr/bin/env bash
# The GPU lab in one call (docs/gpu.md): on a lent GPU machine, in the repo root,
#
#     bash benchmarks/gpu_lab.sh $OUT                 # the whole lab, under 8 minutes
#     bash benchmarks/gpu_lab.sh --dry-run OUTDIR     # seconds: every part's command resolved, none run
#     PYTHON=/path/to/python bash benchmarks/gpu_lab.sh OUTDIR   # another interpreter (default python3)
#     bash benchmarks/gpu_lab.sh --stand-in OUTDIR    # a rehearsal without CUDA: CUDA parts on gloo
#     bash benchmarks/gpu_lab.sh --only "trace on CUDA,doctor" $OUT   # a rerun of the parts named
#
# It installs the wheels carried in .whl/ (bash benchmarks/gpu_wheels.sh made them here) that the
# machine lacks into a folder of their own, never touching its torch; ddpkit itself is not
# installed, the repo root goes on PYTHONPATH (the ranks and the notebook kernel inherit it). Then
# every part runs under its own timeout: doctor, compare, a trace and a memory snapshot on CUDA,
# the GPU tests, the emulated network and two ranks on NCCL, notebooks 00, 02, 04, 05 under
# nbval. OUTDIR gets summary.txt (one line per part: ok / FAILED / SKIPPED and why), logs.txt
# (every part's output) and the files the parts write (compare.json, trace.json,
# snapshot.pickle): at most 8 files. Without CUDA the CUDA parts are skipped, saying so.
# The parts and their runner: benchmarks/gpu_lab_parts.py. Exit status 1 if a part FAILED.
set -uo pipefail
if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
cd "$(dirname "$0")/.." || exit 2
PY="${PYTHON:-python3}"
exec "$PY" benchmarks/gpu_lab_parts.py run "$@"
