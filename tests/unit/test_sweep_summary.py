"""A sweep's summary: the metric's direction and values, the ranking, summary.csv/.md/.png."""
import csv
import math
import sys

import matplotlib  # the dev extra brings it: a failure, not a skip
import pytest

from multigpu.sweep.summary import (RunResult, metric_direction, metric_values, sort_results,
                                    split_metric, write_summary)


def run(params: dict, best: float | None, *, final: float | None = None, status: str | None = None,
        duration_s: float | None = 30.0, note: str = "") -> RunResult:
    name = ",".join(f"{k}={v}" for k, v in params.items()).replace(":", "-")
    status = status or ("done" if best is not None else "failed")
    return RunResult(name, params, status, duration_s, best if final is None else final, best,
                     attempts=1, note=note)


@pytest.fixture
def figures(monkeypatch):
    """The figures write_summary saves, to look at what was drawn."""
    from matplotlib.figure import Figure

    saved, savefig = [], Figure.savefig

    def spy(fig, *args, **kwargs):
        saved.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return saved


def read_csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def is_png(path) -> bool:
    return path.read_bytes()[:4] == b"\x89PNG"


def test_metric_direction_from_the_name_or_an_explicit_suffix():
    assert metric_direction("val_accuracy") is True
    assert metric_direction("accuracy") is True
    assert metric_direction("val_mae") is False
    assert metric_direction("val_loss") is False
    assert metric_direction("val_loss:max") is True
    assert split_metric("val_loss:max") == ("val_loss", True)
    assert split_metric("val_accuracy:min") == ("val_accuracy", False)
    assert split_metric("val_rmse") == ("val_rmse", False)


def test_metric_values_skip_records_without_the_key_or_with_nan():
    records = [{"epoch": 1, "val_mae": 0.5}, {"epoch": 2, "train_loss": 0.9},
               {"epoch": 3, "val_mae": 0.3}, {"epoch": 4, "val_mae": 0.4},
               {"epoch": 5, "val_mae": float("nan")}, {"epoch": 6, "val_mae": None}]
    assert metric_values(records, "val_mae") == (0.4, 0.3)
    assert metric_values(records, "val_mae:max") == (0.4, 0.5)
    acc = [{"val_accuracy": 0.7}, {"val_accuracy": 0.9}, {"val_accuracy": 0.8}]
    assert metric_values(acc, "val_accuracy") == (0.8, 0.9)
    assert metric_values(records, "val_rmse") == (None, None)
    assert metric_values([{"val_mae": math.inf}, {"val_mae": float("nan")}], "val_mae") == (None, None)
    assert metric_values([], "val_mae") == (None, None)


def test_sort_puts_the_best_first_and_runs_without_a_value_last_in_their_order():
    results = [run({"v": 1}, 0.3), run({"v": 2}, None), run({"v": 3}, 0.1),
               run({"v": 4}, None, status="pending"), run({"v": 5}, 0.2)]
    assert [r.params["v"] for r in sort_results(results, False)] == [3, 5, 1, 2, 4]
    assert [r.params["v"] for r in sort_results(results, True)] == [1, 5, 3, 2, 4]
    assert [r.params["v"] for r in results] == [1, 2, 3, 4, 5]  # the input is left as it was


def test_a_2x2_sweep_writes_a_ranked_csv_a_markdown_table_and_a_png(tmp_path):
    results = [run({"seq_length": "40", "future_length": "1"}, 0.31, final=0.35, duration_s=65),
               run({"seq_length": "40", "future_length": "4"}, None, duration_s=3.2,
                   note="exit 1: RuntimeError: CUDA out of memory | try a smaller batch"),
               run({"seq_length": "80", "future_length": "1"}, 0.12, final=0.125, duration_s=7300),
               run({"seq_length": "80", "future_length": "4"}, 0.2, duration_s=12)]
    paths = write_summary(tmp_path, results, ["seq_length", "future_length"], "val_mae")
    assert paths == [tmp_path / "summary.csv", tmp_path / "summary.md", tmp_path / "summary.png"]

    rows = read_csv(tmp_path / "summary.csv")
    assert list(rows[0]) == ["rank", "name", "seq_length", "future_length", "status", "attempts",
                             "duration_s", "final_val_mae", "best_val_mae", "note"]
    assert [(r["rank"], r["seq_length"], r["future_length"], r["status"]) for r in rows] == [
        ("1", "80", "1", "done"), ("2", "80", "4", "done"), ("3", "40", "1", "done"),
        ("", "40", "4", "failed")]
    assert [(float(r["final_val_mae"]), float(r["best_val_mae"])) for r in rows[:3]] == [
        (0.125, 0.12), (0.2, 0.2), (0.35, 0.31)]
    failed = rows[3]
    assert (failed["final_val_mae"], failed["best_val_mae"]) == ("", "")
    assert failed["note"].startswith("exit 1: RuntimeError: CUDA out of memory")
    assert float(rows[2]["duration_s"]) == 65.0

    md = (tmp_path / "summary.md").read_text()
    assert "val_mae" in md.splitlines()[0] and "lower is better" in md.splitlines()[0]
    assert "3 of 4 runs done, 1 failed." in md
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 4  # the header and one row per run
    for r in results:
        assert sum(f"| {r.name} |" in line for line in table) == 1, r.name
    assert "| 1 | seq_length=80,future_length=1 | 80 | 1 | done | 1 | 2h 01m | 0.125 | 0.12 |" in md
    assert "| 3 | seq_length=40,future_length=1 | 40 | 1 | done | 1 | 1m 05s | 0.35 | 0.31 |" in md
    assert "out of memory \\| try" in md  # a | in a note does not split the row
    assert is_png(tmp_path / "summary.png")


def test_one_varying_key_is_a_line_on_a_numeric_axis_in_numeric_order(tmp_path, figures):
    # command-line strings and numbers mixed, given out of order; the constant key is ignored
    results = [run({"data": "co2", "seq_length": "80"}, 0.5), run({"data": "co2", "seq_length": 40}, 0.3),
               run({"data": "co2", "seq_length": "120"}, None),
               run({"data": "co2", "seq_length": "60"}, 0.4)]
    write_summary(tmp_path, results, ["data", "seq_length"], "val_loss")
    assert is_png(tmp_path / "summary.png")
    (ax,) = figures[0].axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [40.0, 60.0, 80.0]  # the failed 120 has no point
    assert list(line.get_ydata()) == [0.3, 0.4, 0.5]
    assert ax.get_xlabel() == "seq_length"
    assert figures[0].get_suptitle() == "val_loss: best per run"


def test_string_values_of_one_key_keep_their_order_on_a_categorical_axis(tmp_path, figures):
    results = [run({"model": "lstm"}, 0.5), run({"model": "gru"}, 0.3), run({"model": "cnn"}, 0.4)]
    write_summary(tmp_path, results, ["model"], "val_mae", title="models")
    (ax,) = figures[0].axes
    assert [t.get_text() for t in ax.get_xticklabels()] == ["lstm", "gru", "cnn"]
    assert list(ax.get_lines()[0].get_ydata()) == [0.5, 0.3, 0.4]
    assert figures[0].get_suptitle() == "models"


def heat_runs(metric_of) -> list[RunResult]:
    """data × seq_length × future_length, with (co2, 80, 4) failed."""
    out = []
    for data in ["co2", "macro"]:
        for seq in ["40", "80"]:
            for fut in ["1", "4"]:
                value = None if (data, seq, fut) == ("co2", "80", "4") else metric_of(data, int(seq), int(fut))
                out.append(run({"data": data, "seq_length": seq, "future_length": fut}, value))
    return out


def test_two_varying_keys_are_a_heat_map_with_blank_cells_for_failed_runs(tmp_path, figures):
    results = [r for r in heat_runs(lambda d, s, f: s / 100 + f / 10) if r.params["data"] == "co2"]
    write_summary(tmp_path, results, ["data", "seq_length", "future_length"], "val_mae")
    assert is_png(tmp_path / "summary.png")
    heat = [ax for ax in figures[0].axes if ax.get_images()]
    assert len(heat) == 1
    grid = heat[0].get_images()[0].get_array().filled(math.nan)
    assert grid[0, 0] == pytest.approx(0.5) and grid[0, 1] == pytest.approx(0.8)  # seq 40 row
    assert grid[1, 0] == pytest.approx(0.9) and math.isnan(grid[1, 1])  # (80, 4) failed
    assert (heat[0].get_ylabel(), heat[0].get_xlabel()) == ("seq_length", "future_length")
    texts = sorted(t.get_text() for t in heat[0].texts)
    assert texts == ["0.5", "0.8", "0.9"]
    assert len(figures[0].axes) == 2  # the heat map and its colour bar


@pytest.mark.parametrize("metric", ["val_mae", "val_accuracy"])
def test_the_best_cell_has_the_same_colour_whichever_direction_is_better(tmp_path, figures, metric):
    higher = metric_direction(metric)
    results = [run({"a": a, "b": b}, v) for a, b, v in [(1, 1, 0.2), (1, 2, 0.5), (2, 1, 0.8), (2, 2, 0.6)]]
    write_summary(tmp_path, results, ["a", "b"], metric)
    image = next(ax for ax in figures[0].axes if ax.get_images()).get_images()[0]
    best, worst = (0.8, 0.2) if higher else (0.2, 0.8)
    viridis = matplotlib.colormaps["viridis"]
    assert tuple(image.cmap(image.norm(best))) == tuple(viridis(1.0))  # yellow
    assert tuple(image.cmap(image.norm(worst))) == tuple(viridis(0.0))


def test_three_varying_keys_are_one_heat_map_per_value_of_the_first_each_on_its_scale(tmp_path, figures):
    results = heat_runs(lambda d, s, f: (d == "macro") + s / 100 + f / 10)
    write_summary(tmp_path, results, ["data", "seq_length", "future_length"], "val_mae")
    assert is_png(tmp_path / "summary.png")
    heat = [ax for ax in figures[0].axes if ax.get_images()]
    assert [ax.get_title() for ax in heat] == ["data=co2", "data=macro"]
    images = [ax.get_images()[0] for ax in heat]
    scales = [v for im in images for v in (im.norm.vmin, im.norm.vmax)]
    assert scales == pytest.approx([0.5, 0.9, 1.5, 2.2])  # co2's (80, 4) failed: its best is 0.9
    grids = [im.get_array().filled(math.nan) for im in images]
    assert math.isnan(grids[0][1, 1]) and grids[1][1, 1] == pytest.approx(2.2)  # co2 (80, 4) failed


def test_more_than_12_panels_fall_back_to_lines_of_the_best_over_the_middle_keys(tmp_path, figures):
    results = [run({"a": a, "b": b, "c": c}, a + b / 10 + c / 100)
               for a in range(13) for b in (1, 2) for c in (1, 2, 3)]
    write_summary(tmp_path, results, ["a", "b", "c"], "val_loss")
    assert is_png(tmp_path / "summary.png")
    (ax,) = [ax for ax in figures[0].axes if ax.get_lines()]
    assert not ax.get_images()
    lines = ax.get_lines()
    assert len(lines) == 13 and lines[0].get_label() == "a=0"
    assert list(lines[2].get_xdata()) == [1, 2, 3]  # against c, the last key
    assert list(lines[2].get_ydata()) == pytest.approx([2.11, 2.12, 2.13])  # b=1, the lower


def test_no_png_when_no_run_has_a_value(tmp_path):
    results = [run({"lr": "1e-3"}, None), run({"lr": "1e-2"}, None, status="pending", duration_s=None)]
    paths = write_summary(tmp_path, results, ["lr"], "val_loss")
    assert paths == [tmp_path / "summary.csv", tmp_path / "summary.md"]
    assert not (tmp_path / "summary.png").exists()
    assert [r["status"] for r in read_csv(tmp_path / "summary.csv")] == ["failed", "pending"]
    assert "0 of 2 runs done, 1 failed, 1 pending." in (tmp_path / "summary.md").read_text()


def test_without_matplotlib_the_tables_are_written_and_the_png_skipped(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    paths = write_summary(tmp_path, [run({"lr": "1e-3"}, 0.5)], ["lr"], "val_loss")
    assert paths == [tmp_path / "summary.csv", tmp_path / "summary.md"]
    assert not (tmp_path / "summary.png").exists()
    assert read_csv(tmp_path / "summary.csv")[0]["best_val_loss"] == "0.5"


def test_panels_of_grids_of_their_own_show_only_their_values(tmp_path, figures):
    """Post 002: the second dataset sweeps other lengths; its panel has no empty rows."""
    results = [run({"data": "co2", "seq_length": s, "future_length": f}, int(s) + int(f))
               for s in ("40", "80") for f in ("1", "4")]
    results += [run({"data": "macro", "seq_length": "8", "future_length": f}, 8 + int(f)) for f in ("1", "2")]
    write_summary(tmp_path, results, ["data", "seq_length", "future_length"], "val_mae")
    heat = [ax for ax in figures[0].axes if ax.get_images()]
    ticks = [([t.get_text() for t in ax.get_yticklabels()], [t.get_text() for t in ax.get_xticklabels()])
             for ax in heat]
    assert ticks == [(["40", "80"], ["1", "4"]), (["8"], ["1", "2"])]
    assert heat[1].get_images()[0].get_array().shape == (1, 2)
