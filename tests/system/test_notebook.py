"""The Python API in a Jupyter notebook: a small notebook executed through nbclient in a kernel of this
interpreter (no network), its saved outputs read as a user would see them.

One notebook, one kernel, one Ray instance (started in its first cell, as a notebook user connected to Ray
would have it; rayfl uses the connected instance and leaves it running): a run, its per-round table, a
two-trial sweep, a two-row comparison in the notebook's process and a mistake. On the embedded digits data
with 40 samples a client, so that each client tests on 8: the partition's caveat and the worst client's
mark (†) must reach the notebook's displays too.
"""

from __future__ import annotations

import json
import re
import sys

import pytest

pytestmark = pytest.mark.slow

SETUP = """\
import ray
import rayfl
ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
common = dict(dataset="digits", clients=3, rounds=2, samples_per_client=40, out_dir={out!r},
              tracking_uri={uri!r})"""
CELLS = {
    "setup": SETUP,
    "run": "r = rayfl.run(**common)\nr",
    "history": "r.history",
    "tune": "s = rayfl.tune(algo='fedavg', space={'grid': {'lr': [0.05, 0.1]}}, **common)\ns",
    "compare": "c = rayfl.compare(['fedavg', 'local'], seeds=[0], runtime='local', **common)\nc",
    "mistake": "rayfl.run(dataset='digits', clients=-1)",
    "end": "ray.shutdown()",
}


def streams(cell) -> str:
    return "".join(o["text"] for o in cell["outputs"] if o["output_type"] == "stream")


def shown(cell, kind: str = "text/html") -> list[str]:
    return [o["data"][kind] for o in cell["outputs"] if o["output_type"] in ("execute_result", "display_data")
            and kind in o["data"]]


@pytest.fixture(scope="module")
def notebook(tmp_path_factory):
    """The notebook, executed; its cells by name."""
    import nbformat
    from nbclient import NotebookClient

    root = tmp_path_factory.mktemp("notebook")
    kernels = root / "jupyter" / "kernels" / "rayfl-test"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "rayfl (this interpreter)", "language": "python"}))
    env = {"JUPYTER_PATH": str(root / "jupyter"), "IPYTHONDIR": str(root / "ipython"),
           "JUPYTER_RUNTIME_DIR": str(root / "runtime")}
    mp = pytest.MonkeyPatch()
    for key, value in env.items():  # the kernel found here first; nothing written to the user's Jupyter folders
        mp.setenv(key, value)
    sources = {**CELLS, "setup": SETUP.format(out=str(root / "runs"), uri=f"sqlite:///{root}/mlflow.db")}
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources.values()])
    try:
        NotebookClient(nb, kernel_name="rayfl-test", timeout=600, allow_errors=True,
                       resources={"metadata": {"path": str(root)}}).execute()
    finally:
        mp.undo()
    nbformat.write(nb, str(root / "executed.ipynb"))  # kept for a look when a test fails
    return dict(zip(sources, nb.cells))


def test_every_cell_but_the_mistake_runs(notebook):
    errors = {name: [o.get("evalue") for o in cell["outputs"] if o["output_type"] == "error"]
              for name, cell in notebook.items()}
    assert {name for name, e in errors.items() if e} == {"mistake"}, errors


def test_a_run_shows_its_lines_and_its_caveats(notebook):
    out = streams(notebook["run"])
    assert "rayfl: fedavg on digits (pathological), 3 clients" in out and "round   2/2" in out
    [html] = shown(notebook["run"])
    assert "RunResult: fedavg on digits, 3 clients, final round 2" in html
    # every client tests on 8 samples: the worst client's value is marked, and the partition's caveat is there
    assert "†" in html and "rests on 8 test samples" in html
    assert "Caveat: 3 of 3 clients have fewer than 10 validation or test samples" in html


def test_history_puts_the_results_first(notebook):
    [html] = shown(notebook["history"])
    headers = re.findall(r"<th>([^<]*)</th>", html.split("</thead>")[0])[1:]  # after the index's
    assert headers[:8] == ["round", "stage", "test_acc_mean", "test_acc_worst", "test_acc_bottom10_mean",
                           "val_acc_mean", "val_acc_worst", "val_acc_bottom10_mean"]
    assert "..." in headers  # pandas elided some: the timings are after it, the results before
    assert all(h.endswith("_seconds") for h in headers[-5:]) and not any(h.endswith("_seconds") for h in headers[:8])
    [text] = shown(notebook["history"], "text/plain")
    assert text.split()[:5] == ["round", "stage", "test_acc_mean", "test_acc_worst", "test_acc_bottom10_mean"]


def test_tune_keeps_rayfl_lines_and_shows_its_table_once(notebook):
    cell = notebook["tune"]
    out = streams(cell)
    # the lines printed before Tune started are still there: Tune's notebook reporter did not clear the cell
    assert "rayfl tune: fedavg, 2 trial(s): lr in {0.05, 0.1} (grid)" in out
    assert "rayfl tune: partition: 3 clients" in out and "rayfl tune: 2/2 done" in out
    assert all(o["output_type"] != "display_data" for o in cell["outputs"])  # no (empty) Tune display either
    # the results table once: in the result's display, not printed as well
    assert "sweep results" not in out and "best (val_acc_mean" not in out
    [html] = shown(cell)
    assert html.count("<table") == 1 and "SweepResult: fedavg sweep, 2 trials (2 done)" in html


def test_compare_shows_its_progress_and_one_number_format(notebook):
    out = streams(notebook["compare"])
    assert "compare: 2 rows x 1 seeds = 2 runs (one at a time, in this process)" in out
    assert "compare: 1/2 done" in out and "compare: 2/2 done" in out
    [html] = shown(notebook["compare"])
    cells = re.findall(r"<td>([^<]*)</td>", html)
    # accuracy in percent, as the Markdown table has it (one seed: no ± std), the worst client marked
    assert cells[:2] == ["fedavg", "1"] and re.fullmatch(r"\d{1,3}\.\d\d", cells[2]), cells
    assert re.fullmatch(r"\d{1,3}\.\d\d†", cells[3]) and "rests on 8 test samples" in html
    assert "Caveat: 3 of 3 clients have fewer than 10 validation or test samples" in html


def test_a_mistake_is_one_line(notebook):
    [error] = [o for o in notebook["mistake"]["outputs"] if o["output_type"] == "error"]
    assert error["ename"] == "UserError"
    assert error["traceback"] == ["rayfl: error: clients=-1: must be an integer >= 1"]
