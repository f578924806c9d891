#!/usr/bin/env bash
# The wheels benchmarks/gpu_lab.sh carries to a lent GPU machine (docs/gpu.md): what the kit
# needs beside that machine's own torch and which its image lacks, for its Python (3.12, x86-64).
#
#     bash benchmarks/gpu_wheels.sh            # -> .whl/        (Python 3.12: the GPU machine's)
#     bash benchmarks/gpu_wheels.sh 3.11       # -> .whl-3.11/   (a rehearsal on this machine's 3.11)
#
# The image (/work/.library/device/KINDS.md) has torch 2.11, pytest, pytest-timeout, pytest-xdist,
# matplotlib, numpy, cloudpickle, psutil, transformers, attrs, coverage, packaging, pygments,
# python-dateutil, six, typing-extensions and jinja2, and no Jupyter at all. nbval runs the
# notebooks in a kernel of the running Python (--nbval-current-env), so it needs ipykernel and
# what ipykernel, jupyter_client and nbformat import; the notebooks display ipywidgets. So:
# exactly those, one pinned version each (two versions of one package break the install there),
# downloaded without their dependencies (--no-deps: every one is named here). Nothing that is or
# needs torch. Left out on purpose: debugpy (ipykernel's debugger, imported only if present; a
# few MB of compiled wheel), jupyterlab/notebook (no server runs there).
#
# cloudpickle is on the image, but maybe not inside the kit's range (pyproject: <3.1.3, which
# renames pickled functions' files and loses a rank's traceback lines): gpu_lab.sh installs a
# carried wheel only where the image lacks the package or holds a version outside the kit's range.
set -euo pipefail

PYVER="${1:-3.12}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [[ "$PYVER" == 3.12 ]]; then DEST="$ROOT/.whl"; else DEST="$ROOT/.whl-$PYVER"; fi

WHEELS=(
    # the notebook runner and its kernel
    nbval==0.11.0
    ipykernel==7.4.0
    jupyter_client==8.10.0
    jupyter_core==5.9.1
    pyzmq==27.3.0            # compiled (per Python version)
    tornado==6.6.1           # compiled (abi3)
    traitlets==5.15.0
    comm==0.2.3
    nest-asyncio2==1.7.4
    platformdirs==4.14.8
    # IPython 9 (Python >= 3.11) and what it imports
    ipython==9.18.1
    ipython-pygments-lexers==1.1.1
    decorator==5.2.1
    jedi==0.20.0
    parso==0.8.7
    matplotlib-inline==0.2.2
    pexpect==4.9.0
    ptyprocess==0.7.0
    prompt_toolkit==3.0.52
    wcwidth==0.7.0
    stack_data==0.6.3
    asttokens==3.0.1
    executing==2.2.1
    pure_eval==0.2.3
    # nbformat validates the notebooks with jsonschema
    nbformat==5.11.1
    fastjsonschema==2.22.3
    jsonschema==4.26.0
    jsonschema-specifications==2025.9.1
    referencing==0.37.0
    rpds-py==0.30.0          # compiled (per Python version)
    # the Cluster widget the notebooks display
    ipywidgets==8.1.9
    widgetsnbextension==4.0.16
    jupyterlab_widgets==3.0.17
    # the kit's range (see above); installed there only if the image's is outside it
    cloudpickle==3.1.2
)

PY="${PYTHON:-python3}"
rm -rf "$DEST"
mkdir -p "$DEST"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DEST" "${WHEELS[@]}"

got=$(find "$DEST" -type f -name '*.whl' | wc -l)
if [[ "$got" -ne "${#WHEELS[@]}" ]]; then
    echo "expected ${#WHEELS[@]} wheels in $DEST, got $got" >&2
    exit 1
fi
# every Requires-Dist of every wheel is carried or on the image (markers read for $PYVER)
"$PY" "$ROOT/benchmarks/gpu_lab_parts.py" check-wheels "$DEST" "$PYVER"

tree=$(cd "$ROOT" && git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
wheels=$(du -sb "$DEST" | cut -f1)
echo "$got wheels in ${DEST#"$ROOT"/}: $((wheels / 1024)) KiB; with the tracked tree ($((tree / 1024)) KiB):" \
     "$(((tree + wheels) / 1024 / 1024)) MiB of the 64 MiB a device call carries"
