"""What a run's results look like as tables and text: the rows a run, its rounds and its clients become (the
API's pandas tables, the client CSV a round logs), the final summary, the run's one-line setting and its
Markdown description, and the plain numbers of a metrics dict. No MLflow here: the tracker logs these, the API
returns them.
"""

from __future__ import annotations

import csv
import itertools
import math

import numpy as np

from rayfl import privacy

CLIENT_PREFIX = "client/"  # per-client metrics: client/<id>/test_acc
# The run page's model-metrics tab lays its charts out by metric key (MLflow 3.17, RunsChartsCardConfig
# .getBaseChartAndSectionConfigs: a key's section is what comes before its last "/", sections in alphabetical
# order before the unprefixed "Model metrics" one, charts sorted by key within a section; the layout a user
# makes is kept in the browser, none can be saved with a run). The three headline curves are therefore also
# logged as "accuracy/test mean", "accuracy/test worst", "accuracy/test worst 10pct" (the bottom-10% mean;
# "loss/..." for regression): a section that sorts before "client/<id>" and "setup", charts in that order,
# so the tab opens on them, timings and diagnostics below.
HEADLINE = {"mean": "test mean", "worst": "test worst", "bottom10_mean": "test worst 10pct"}


def headline(metrics: dict[str, float]) -> dict[str, float]:
    """The round's test accuracy (loss for regression) mean, worst client and bottom-10% mean under the
    names the run page shows first."""
    kind = "acc" if "test_acc_mean" in metrics else "loss"
    section = "accuracy" if kind == "acc" else "loss"
    return {f"{section}/{name}": metrics[f"test_{kind}_{stat}"] for stat, name in HEADLINE.items()
            if f"test_{kind}_{stat}" in metrics}


# A sweep's trial also logs the metric its sweep selects on under "Selection/<metric>". MLflow 3.17 orders metric
# keys by their UTF-16 code units wherever it lists them (the compare page's metrics table, Utils.getKeys; the
# runs table's metric columns; the chart sections and their charts, getBaseChartAndSectionConfigs), and an
# upper-case letter sorts before every lower-case one: this section comes before "accuracy", as MLflow's own
# "Model metrics" and "System metrics" sections are capitalized too. Its Overview lists the metrics in the order
# they were first logged: it is logged first.
SELECTION_PREFIX = "Selection/"


def _with_headline(metrics: dict[str, float], selection: str | None = None) -> dict[str, float]:
    """The selection metric of a sweep's trial (``selection``, when the round has it) first, then the headline,
    then test and validation summaries, then the rest: the run's Overview lists its metrics in the order they
    were first logged."""
    chosen = {SELECTION_PREFIX + selection: metrics[selection]} if selection in metrics else {}
    first = {k: v for k, v in metrics.items() if k.startswith(("test_", "val_"))}
    return {**chosen, **headline(metrics),
            **dict(sorted(first.items(), key=lambda kv: not kv[0].startswith("test_"))), **metrics}


def pick_rounds(total: int, k: int = 5) -> list[int]:
    """``k`` rounds spread over 1..total, the first and the last among them: those a round-by-round matrix
    is drawn at."""
    return sorted({int(round(x)) for x in np.linspace(1, total, min(k, total))}) if total > 0 else []



def client_table(per_client: dict[int, dict], info):
    """A row per client: its results first (test, then validation, then any other split's accuracy and loss),
    then split sizes, then its group where the partition has groups, then the rest."""
    import pandas as pd

    rows = [{"client": c, **rec, "n_train": info.n_train[c], **({"group": info.groups[c]} if info.groups else {})}
            for c, rec in sorted(per_client.items())]
    df = pd.DataFrame(rows)
    cols = list(df.columns)
    results = [c for split in ("test", "val") for c in (f"{split}_acc", f"{split}_loss") if c in cols]
    results += [c for c in cols if c.endswith(("_acc", "_loss")) and c not in results]
    sizes = ["n_train", *(c for c in cols if c.startswith("n_") and c != "n_train")]
    first = ["client", *results, *sizes, *(["group"] if "group" in cols else [])]
    return df[first + [c for c in cols if c not in first]]


def rounds_table(history: list[dict]):
    """A row per round, numbered from 1 as on the console and in MLflow's steps, results first: the round and
    its stage, the test and validation mean, worst client and bottom 10% (accuracy, or loss for regression),
    the rest of the test and validation summaries, the other metrics, and the timings (``*_seconds``) last, so
    that a notebook's elided wide table (pandas' ``...``) keeps the results in view."""
    import pandas as pd

    df = pd.DataFrame(history)
    if "step" in df:
        df.insert(0, "round", df.pop("step") + 1)
    return df[round_columns(list(df.columns))]


def round_columns(columns: list[str]) -> list[str]:
    """``columns`` of a rounds table in the order :func:`rounds_table` gives them."""
    kind = "acc" if "test_acc_mean" in columns or "val_acc_mean" in columns else "loss"
    head = [c for c in ("round", "stage", *(f"{split}_{kind}_{stat}" for split in ("test", "val")
                                           for stat in ("mean", "worst", "bottom10_mean"))) if c in columns]
    timings = [c for c in columns if c.endswith("_seconds") and c not in head]
    summaries = [c for c in columns if c.startswith(("test_", "val_")) and c not in head + timings]
    rest = [c for c in columns if c not in head + timings + summaries]
    return head + summaries + rest + timings


def final_summary(final: dict) -> dict:
    """The final round's metrics, naming the round (from 1) and its stage."""
    out = {"round": int(final["step"]) + 1} if "step" in final else {}
    if "stage" in final:
        out["stage"] = final["stage"]
    return {**out, **{k: v for k, v in numeric(final, finite_only=False).items() if k != "step"}}


def setting(cfg, final: dict | None = None) -> str:
    """What ran, in one line (rayfl.provenance.describe), with the ε a private run reached."""
    from rayfl.provenance import describe

    return describe(cfg) + privacy.describe(cfg, final)


def shown_value(key: str, value: float) -> str:
    """A metric as the descriptions write it: an accuracy (``..._acc_...``) as a percentage, anything else (a
    loss) to four decimals."""
    return f"{value:.2%}" if "_acc" in key else f"{value:.4f}"


def test_parts(final: dict, stats: tuple[str, ...] = ("mean", "worst", "bottom10_mean"), bold: bool = True) -> list[str]:
    """The final round's test accuracy (loss for regression) as the descriptions' first lines say it:
    ``**test accuracy 91.23%**``, ``worst client 50.00%``, ``bottom 10% 62.50%`` (those of ``stats`` it holds)."""
    kind = "acc" if "test_acc_mean" in final else "loss"
    names = {"mean": f"test {'accuracy' if kind == 'acc' else 'loss'}", "worst": "worst client",
             "bottom10_mean": "bottom 10%"}
    parts = []
    for stat in stats:
        key = f"test_{kind}_{stat}"
        if final.get(key) is not None:
            text = f"{names[stat]} {shown_value(key, final[key])}"
            parts.append(f"**{text}**" if bold and stat == "mean" else text)
        elif stat == "mean":
            parts.append("**no test evaluation**" if bold else "no test evaluation")
    return parts


def first_line(cfg, final: dict, report=None) -> str:
    """The description's opening line, all that MLflow's folded Overview is sure to show: the final round's test
    mean, worst client and bottom 10%, the algorithm and data, the ε a private run reached, and the partition's
    caveat when it has one."""
    line = " · ".join(test_parts(final)) + f" — {cfg.algo} on {cfg.dataset} ({cfg.partition}), {cfg.clients} clients"
    eps = privacy.final_epsilon(cfg, final)
    if eps is not None:
        line += f", DP ε {eps:.3g}"
    warning = report.warning() if report is not None else None
    return line + (f". **Caveat:** {warning}" if warning else "")


def best_trial_line(metric: str, final: dict) -> str:
    """A sweep parent's opening line: the best trial's selection metric, named (the sweep chose on it, not on
    test), then that trial's test mean and worst client, as :func:`first_line` writes them."""
    return " · ".join([f"**best {metric} {shown_value(metric, final[metric])}**",
                       *test_parts(final, ("mean", "worst"), bold=False)])


def summary_markdown(cfg, final: dict, total: int, report=None, setting: str = "") -> str:
    """The run's description, what its Overview shows of it before "Show more": one line with the answer
    (:func:`first_line`), then the final round's mean, worst client and bottom 10% as a table, the setting and
    the partition report. MLflow draws the table without cell padding: the header cells carry an em space."""
    where = f"final round {int(final['step']) + 1} of {total}" if "step" in final else "final round"
    stage = f" ({final['stage']})" if final.get("stage") else ""
    lines = [first_line(cfg, final, report), "",
             f"| {where}{stage} &emsp; | mean &emsp; | worst client &emsp; | bottom 10% &emsp; |", "|---|---|---|---|"]
    for split, name in (("test", "test"), ("val", "validation")):
        for kind, what in (("acc", "accuracy"), ("loss", "loss")):
            if f"{split}_{kind}_mean" in final and (kind == "acc" or "test_acc_mean" not in final):
                values = [final.get(f"{split}_{kind}_{s}", float("nan")) for s in ("mean", "worst", "bottom10_mean")]
                shown = [shown_value(f"{split}_{kind}", v) for v in values]
                shown = [f"**{v}**" for v in shown] if split == "test" else shown
                lines.append(f"| {name} {what} | " + " | ".join(shown) + " |")
    lines += ["", setting or cfg.algo]
    if report is not None:
        lines += ["", f"Partition: {report.line()}."]
        warning = report.warning()
        if warning:
            lines += ["", f"**Warning:** {warning}."]
    return "\n".join(lines) + "\n"


def numeric(metrics: dict, finite_only: bool = True) -> dict[str, float]:
    """The plain numbers of a metrics dict; NaN and infinities are kept only when ``finite_only`` is off
    (MLflow stores them, and a diverged run should show as one)."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
            and (not finite_only or math.isfinite(float(v)))}


def write_client_table(path: str, round_no: int, per_client: dict[int, dict]) -> None:
    """A round's per-client records as CSV, a row per client and a column per key (empty where a record has
    none, or NaN), reading back as pandas' to_csv of the same records does. At 1,000 clients this runs every
    round in the driver's process: the numbers are formatted by Arrow's C++ writer, which releases the GIL
    (the csv module held it about 3 ms a round, and the loop's thread waited), and by the csv module when a
    column holds anything else."""
    cids = sorted(per_client)
    records = [per_client[c] for c in cids]
    keys = list(dict.fromkeys(itertools.chain.from_iterable(records)))  # first seen first
    rows = [[round_no] * len(cids), cids, *(list(map(dict.get, records, itertools.repeat(k))) for k in keys)]
    table = _numbers_table(rows)
    with open(path, "w", newline="") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["round", "client", *keys])
        if table is None:
            out.writerows(zip(*([None if v is None or v != v else v for v in column]  # v != v: NaN
                                for column in rows)))
    if table is not None:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        with pa.OSFile(path, "ab") as sink:
            pcsv.write_csv(table, sink, write_options=pcsv.WriteOptions(include_header=False, quoting_style="none"))


def _numbers_table(columns: list[list]):
    """``columns`` as an Arrow table that its CSV writer writes as pandas would, or None unless every column
    holds only numbers and None."""
    try:
        import pyarrow as pa
        import pyarrow.compute as pc
    except ImportError:  # MLflow brings pyarrow; without it, the csv module writes the table
        return None
    arrays = []
    for column in columns:
        try:
            array = pa.array(column)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # numbers mixed with other things
            return None
        if pa.types.is_floating(array.type):  # a float32 as numpy writes it; NaN empty
            values = array.to_numpy(zero_copy_only=False)
            nan = np.isnan(values)
            if nan.any():
                array = pc.if_else(pc.is_nan(array), None, array)
            values = values[~nan]
            if values.size and (np.floor(values) == values).all():  # Arrow writes 1.0 as 1: pandas would read
                text = pc.cast(array, pa.string())  # integers back (a column with a 0.5 in it reads as floats)
                bare = pc.match_substring_regex(text, r"^-?[0-9]+$")
                array = pc.if_else(bare, pc.binary_join_element_wise(text, ".0", ""), text)
        elif not (pa.types.is_integer(array.type) or pa.types.is_null(array.type)):
            return None  # booleans (Arrow writes true, not True)
        arrays.append(array)
    return pa.table(arrays, names=[str(i) for i in range(len(arrays))])
