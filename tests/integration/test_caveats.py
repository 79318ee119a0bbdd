"""The caveats travel with the numbers: on a federation whose clients test on 6 samples each, the partition's
warning and the worst client's mark († rests on 6 test samples) reach ``rayfl run``'s closing table, each
comparison child run's description (its first line) and the comparison's table (table.md, the Markdown)."""

from __future__ import annotations

import os
import re
from html import escape

# 30 samples a client: 18 training, 6 validation, 6 test (val_frac = test_frac = 0.2)
SMALL = dict(dataset="synthetic", partition="iid", clients=3, rounds=2, samples_per_client=30, lr=0.1, batch_size=16)
WARNING = "3 of 3 clients have fewer than 10 validation or test samples (fewest: 6 validation, 6 test)"
NOTE = "† rests on 6 test samples (the worst client's; fewer than 10, it moves in steps of 1/6)"


def test_a_comparisons_children_and_table_carry_the_caveats(mlflow_uri, tmp_path):
    from mlflow.tracking import MlflowClient

    from rayfl.comparison import compare

    res = compare(["local", "fedavg"], [0], runtime="local", tracking_uri=mlflow_uri, experiment="caveats",
                  progress=False, out_dir=str(tmp_path / "runs"), name="small", **SMALL)
    assert res.caveat.startswith(WARNING)
    assert list(res.runs["test_worst_samples"]) == [6, 6]
    # the table: every worst-client cell marked, the footnote and the caveat under it
    table_md = open(os.path.join(res.out_dir, "table.md")).read()
    rows = [line for line in table_md.splitlines() if line.startswith(("| local", "| fedavg"))]
    assert len(rows) == 2 and all(re.search(r"\| \d+\.\d\d† \|", row) for row in rows), rows
    assert f"\n\n{NOTE}\n\n" in table_md and f"**Caveat:** {WARNING}" in table_md
    assert res.markdown in table_md and escape(NOTE) in res._repr_html_()
    # each child run's description opens with its numbers and the caveat, as a single run's does
    client = MlflowClient(mlflow_uri)
    children = client.search_runs([client.get_experiment_by_name("caveats").experiment_id],
                                  f"tags.mlflow.parentRunId = '{res.run_id}'")
    assert len(children) == 2
    for child in children:
        first = child.data.tags["mlflow.note.content"].splitlines()[0]
        assert first.startswith("**test accuracy ") and f"**Caveat:** {WARNING}" in first, first


def test_a_run_closing_table_carries_the_caveats(ray_session, mlflow_uri, tmp_path, capsys):
    from rayfl.cli import main

    argv = ["run", *(f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()), f"--tracking-uri={mlflow_uri}",
            f"--out-dir={tmp_path}", "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("final round 2 (train), across clients:"):].splitlines()
    assert re.match(r"test_acc\s+(\d\.\d{4}\s+){3}\d\.\d{4}†\s+\d\.\d{4}$", table[2]), table
    assert [line.split()[0] for line in table[1:5]] == ["mean", "test_acc", "val_acc", "test_loss"]
    assert table[5] == NOTE and table[6].startswith(f"caveat: {WARNING}: their accuracy moves in steps of 1/n")
