"""The course in a free cloud notebook (Colab, Kaggle: README "In a free cloud notebook"), what can be
checked without one; the kernels built from their package lists run the notebooks in ``.ci/cloud``.

- the repository's address is written once (``pyproject.toml`` ``[project.urls]``): every notebook's
  first cell clones it and the README's "Open in Colab / Kaggle" links point into it, one row per notebook;
- the doctor names the hosted runtime from its environment variables;
- a short ``/dev/shm``: the shared-memory transport takes smaller regions, or says what to do;
- the widget's view bundle (``view_bundle``) is what ipywidgets 7 and 8 both display for a widget.
"""
from __future__ import annotations

import json
import re
import threading
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
URL = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]["Repository"]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9]*.ipynb"))


def readme_rows() -> list[str]:
    """The README's table of links, one row per notebook, made from the address in pyproject.toml
    (print them: ``python tests/test_cloud.py``)."""
    path = URL.removeprefix("https://github.com/")
    rows = []
    for nb in NOTEBOOKS:
        file = f"{path}/blob/main/notebooks/{nb.name}"
        rows.append(f"| `{nb.stem}` | [Open in Colab](https://colab.research.google.com/github/{file}) | "
                    f"[Open in Kaggle](https://kaggle.com/kernels/welcome?src=https://github.com/{file}) |")
    return rows


def first_code_cell(nb: Path) -> str:
    return "".join(next(c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code")["source"])


def test_the_readme_links_every_notebook_from_the_one_address():
    readme = (ROOT / "README.md").read_text()
    missing = [row for row in readme_rows() if row not in readme]
    assert not missing, "README.md lacks (or has other) rows; print them with python tests/test_cloud.py:\n" + \
        "\n".join(missing)
    others = set(re.findall(r"https://github\.com/[\w.-]+/[\w.-]+", readme)) - {URL}
    assert not others, f"README.md names other repositories than pyproject.toml's {URL}: {others}"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_first_cell_clones_the_address_and_installs_it_with_pip_magic(nb):
    cell = first_code_cell(nb)
    clone = f"!git clone --quiet --depth 1 {URL} ddpkit-course"
    assert clone in cell and "%pip install --quiet ./ddpkit-course" in cell, cell
    assert cell.index(clone) < cell.index("sys.path.insert(0, str(ROOT))")
    assert 'HERE / "ddpkit-course"' in cell   # exercises/ and solutions/ reached in the clone


def test_the_doctor_names_the_runtime_by_its_environment():
    from ddpkit.doctor import runtime

    assert runtime({"COLAB_RELEASE_TAG": "release-colab_20260801"}) == "Colab (COLAB_RELEASE_TAG set)"
    assert runtime({"COLAB_GPU": "1"}).startswith("Colab")
    assert runtime({"KAGGLE_KERNEL_RUN_TYPE": "Interactive", "KAGGLE_URL_BASE": "https://www.kaggle.com"}) == \
        "Kaggle (KAGGLE_KERNEL_RUN_TYPE, KAGGLE_URL_BASE set)"
    assert runtime({"HOME": "/root"}) == "no hosted notebook (Colab, Kaggle) recognised"


def _segments(size: int, region: int):
    """A 2-rank group's Segments made in two threads over one store: (segments, errors)."""
    import torch.distributed as dist

    from ddpkit.comm.transport.segment import Segment, unlink_segments

    store, made, errors, prefix = dist.HashStore(), {}, {}, f"dktest{threading.get_ident()}_"

    def make(rank):
        try:
            made[rank] = Segment(store, rank, size, 8, region, prefix)
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            errors[rank] = exc
            store.set("ddpkit_shm/token", "failed 0")   # let the waiting rank go

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    unlink_segments(prefix)   # what a failed setup left (a Cluster's parent does this)
    return made, errors


def test_a_short_dev_shm_gives_smaller_regions_or_a_clear_error(monkeypatch):
    import torch

    from ddpkit.comm.transport import segment

    real = segment._reserve
    room = {"bytes": 4 << 20}   # a /dev/shm with 4 MiB free: the default 32 MiB slab does not fit

    def short(fd, nbytes):
        if nbytes > room["bytes"]:
            raise segment.ShmError(f"the shared-memory transport needs {nbytes} bytes (short /dev/shm)")
        real(fd, nbytes)

    monkeypatch.setattr(segment, "_reserve", short)
    made, errors = _segments(2, 2 << 20)
    assert not errors and made[0].region == made[1].region < 2 << 20
    assert made[0].nbytes <= room["bytes"] and made[0].region >= segment.MIN_REGION
    made[0].views(torch.float32)[3, 0, :4] = torch.arange(4.0)   # rank 0 writes, rank 1 sees it
    assert made[1].views(torch.float32)[3, 0, :4].tolist() == [0.0, 1.0, 2.0, 3.0]

    room["bytes"] = 64 << 10    # not even the smallest regions: the clear error, no crash
    made, errors = _segments(2, 2 << 20)
    assert isinstance(errors.get(0), segment.ShmError) and "short /dev/shm" in str(errors[0])


def test_the_view_bundle_is_the_widgets_own_on_ipywidgets_7_and_8():
    import ipywidgets as w

    from ddpkit.predictions.form import view_bundle

    box = w.VBox([w.HTML("x")])
    bundle = view_bundle(box, "what a front end without widgets shows")
    assert bundle["text/plain"] == "what a front end without widgets shows"
    view = bundle["application/vnd.jupyter.widget-view+json"]
    assert view["model_id"] == box.model_id and view["version_major"] == 2
    if hasattr(box, "_repr_mimebundle_"):   # ipywidgets 8 builds the same view itself
        assert box._repr_mimebundle_()["application/vnd.jupyter.widget-view+json"] == view


if __name__ == "__main__":
    print("\n".join(readme_rows()))
