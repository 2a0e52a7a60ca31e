"""benchmarks/auto_public_scripts.py's own harness, on CPU, with a stand-in for the public
ImageNet script (torchvision is not needed): what it reports must be about the run it made."""
import json
import textwrap
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"

# Prints what pytorch/examples' ImageNet main.py prints, reads a shuffled loader of 32 samples
# once, and saves the script's two files: every training sample fetched once.
STAND_IN = textwrap.dedent('''
    import sys
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(32.0).unsqueeze(1), torch.zeros(32, dtype=torch.long))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    for i, _ in enumerate(loader):
        print(f"Epoch: [0][{i + 1:2d}/{len(loader)}]\\tTime  0.100 ( 0.100)", flush=True)
    print(" * Acc@1 50.000 Acc@5 100.000")
    torch.save({}, "checkpoint.pth.tar")
    torch.save({}, "model_best.pth.tar")
''')


@pytest.fixture
def harness(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import auto_public_runs as runs
    import auto_public_scripts as scripts

    script = tmp_path / "scripts" / "imagenet" / "main.py"
    script.parent.mkdir(parents=True)
    script.write_text(STAND_IN)
    rel, _, data_rel = scripts.SCRIPTS["imagenet"]
    monkeypatch.setitem(scripts.SCRIPTS, "imagenet", (rel, runs.blob_id(script), data_rel))
    return scripts, tmp_path


def test_a_second_call_into_the_same_out_reports_its_own_runs_only(harness):
    scripts, tmp = harness
    argv = ["--devices-kind", "cpu", "--only", "imagenet", "--gpus", "", "--out",
            str(tmp / "out"), "--scripts", str(tmp / "scripts")]
    for _ in range(2):
        assert scripts.main(argv) == 0
    latest = json.loads((tmp / "out" / "results.json").read_text())
    (run,) = latest["runs"]
    assert run["rc"] == 0
    assert run["samples"]["passes"] == [{"dataset": "TensorDataset|.|None", "epoch": 0, "len": 32,
                                         "fetched": 32, "ranks": 1, "missing": 0,
                                         "repeated": 0, "complete": True}]
    assert run["samples"]["once_per_epoch"] is True
    assert run["saved"] == ["checkpoint.pth.tar", "model_best.pth.tar"]
    assert "/call-2/" in run["log"]
    first = json.loads((tmp / "out" / "call-1" / "results.json").read_text())
    assert first["runs"][0]["samples"]["once_per_epoch"] is True
    assert "/call-1/" in first["runs"][0]["log"]


# A one-GPU script as the corpus' are: a shuffled loader of 32 samples for two epochs, an
# optimizer, its metric printed, a checkpoint saved with torch.save, a peek at the loader first.
CORPUS_STAND_IN = textwrap.dedent('''
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    next(iter(loader))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    print("acc: 0.5")
    torch.save(model.state_dict(), "model.pt")
''')


@pytest.mark.extended  # two runs through the launcher: about 40 s on 2 loaded cores
def test_the_corpus_harness_reports_each_rank_and_the_file_rank_0_saved(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import auto_corpus as corpus
    import auto_public_runs as runs
    import auto_public_scripts as scripts

    script = tmp_path / "scripts" / "corpus" / "standin" / "train.py"
    script.parent.mkdir(parents=True)
    script.write_text(CORPUS_STAND_IN)
    pin = corpus.Pin("someone/somewhere", "0" * 40, "train.py", runs.blob_id(script))
    monkeypatch.setitem(corpus.CORPUS, "standin",
                        corpus.Entry("standin", pin, r"acc: ([\d.]+)", "acc"))
    assert scripts.main(["--corpus", "standin", "--devices-kind", "cpu", "--gpus", "2",
                         "--one-process-runs", "1", "--out", str(tmp_path / "out"),
                         "--scripts", str(tmp_path / "scripts")]) == 0
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    one, auto = doc["runs"]
    assert (one["rc"], auto["rc"]) == (0, 0)
    assert auto["files"] == {"model.pt": {"ranks": [0], "broken": None}}
    assert sorted(auto["steps"]) == ["0", "1"] and auto["steps"]["0"] == 8  # 2 epochs x 4/2 steps
    assert auto["weights"]["0"] == auto["weights"]["1"]
    train = [p for p in auto["passes"] if p["complete"]]
    assert [(p["fetched"], p["missing"], p["repeated"], p["ranks"]) for p in train] == [
        (32, 0, 0, 2)] * 2
    assert doc["summary"]["standin"]["auto-2"] == {
        "verdict": "right", "reasons": [], "metric": 0.5, "metric_rank0": 0.5, "rc": 0,
        "wall_s": auto["wall_s"],
        "notes": [], "observed": ["metric", "samples", "files", "weights"]}
