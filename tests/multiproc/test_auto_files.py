"""`multigpu run --auto`: the files an unmodified one-device script writes come out whole and
once, rank 0's, as one process writes them; the other ranks' writes go to their own copies under
the run's log folder, where each reads its own back."""
from __future__ import annotations

import json
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from tests.multiproc.test_run_cli import multigpu

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "auto_files_writes.py"
OUT = ["out/array.npy", "out/best.txt", "out/model.pt", "out/plot.png", "out/sample.txt",
       "out/samples/image.png"]


def folders(tmp_path: Path, name: str) -> tuple[Path, dict[str, str]]:
    """A folder to run in, and an environment whose temp folder is beside it: the temp folder
    passes untouched and tmp_path is in the system's, so the run's folder must be outside it."""
    work, tmp = tmp_path / name, tmp_path / f"{name}-tmp"
    work.mkdir()
    tmp.mkdir()
    return work, {"TMPDIR": str(tmp)}


def user_files(work: Path) -> list[str]:
    return sorted(str(p.relative_to(work)) for p in work.rglob("*")
                  if p.is_file() and p.parts[len(work.parts)] != "runs")


def reports(env: dict[str, str]) -> dict[int, dict]:
    return {int(p.stem[len("report_rank"):]): json.loads(p.read_text())
            for p in Path(env["TMPDIR"]).glob("report_rank*.json")}


def one_process(tmp_path: Path, monkeypatch) -> Path:
    """The files the script writes as one process (rank 0): what the run's must be, byte for
    byte. Written here, by the script's own function, into a folder of their own."""
    alone = tmp_path / "one"
    alone.mkdir()
    script = the_script(monkeypatch)
    monkeypatch.chdir(alone)
    script.write(0, script.Net())
    monkeypatch.chdir(tmp_path)
    return alone


def the_script(monkeypatch):
    """The script as a module (its functions and classes, not its main), importable by name so
    that pickle finds its classes."""
    spec = importlib.util.spec_from_file_location(SCRIPT.stem, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, SCRIPT.stem, module)
    spec.loader.exec_module(module)
    return module


def check_run(tmp_path: Path, monkeypatch, nproc: int) -> None:
    work, env = folders(tmp_path, "auto")
    r = multigpu("--auto", "--devices", f"cpu:{nproc}", str(SCRIPT), cwd=work, timeout=240, **env)
    assert r.returncode == 0, r.stderr[-3000:]
    alone = one_process(tmp_path, monkeypatch)

    # every file whole and once: the bytes one process writes (rank 0's), nothing else there
    assert user_files(work) == user_files(alone) == OUT
    for name in OUT:
        if name != "out/model.pt":  # pickled weights: equal values, checked below
            assert (work / name).read_bytes() == (alone / name).read_bytes(), name
    net = the_script(monkeypatch).Net
    monkeypatch.setattr(sys.modules["__main__"], "Net", net, raising=False)  # the script's class
    model = torch.load(work / "out/model.pt", weights_only=False)  # as its __main__ names it
    assert type(model) is net and sorted(model.state_dict()) == ["fc.bias", "fc.weight"]

    # the others' writes: in their own copies, under the run's log folder, said once
    notes = [line for line in r.stderr.splitlines() if line.startswith("multigpu: note: --auto")]
    logs = next((work / "runs" / "logs").iterdir())
    assert notes == [f"multigpu: note: --auto: out/sample.txt: the files this script writes are "
                     f"rank 0's; the other ranks write theirs to their own copies, under "
                     f"runs/logs/{logs.name}/files/rank<N>/, and read those back"]
    for rank in range(1, nproc):
        copies = Path(f"{logs}/files/rank{rank}{work}")
        assert sorted(str(p.relative_to(copies)) for p in copies.rglob("*") if p.is_file()) == OUT
        assert (copies / "out/sample.txt").read_text().startswith(f"a sample of rank {rank}\n")

    # each rank read back what it wrote itself
    seen = reports(env)
    assert sorted(seen) == list(range(nproc))
    for rank, report in seen.items():
        assert report == {
            "sample": f"a sample of rank {rank}\n", "best": True, "pixel": rank * 100,
            "array": [rank] * 3, "plot": [200, 200], "model_class": "Net", "model_equal": True,
            "out": ["array.npy", "best.txt", "model.pt", "plot.png", "sample.txt", "samples"],
            "scratch": False}, rank


def test_each_file_written_is_rank_0s_whole_and_every_rank_reads_its_own_back(tmp_path,
                                                                            monkeypatch):
    check_run(tmp_path, monkeypatch, 2)


@pytest.mark.extended
def test_three_processes_two_of_them_in_copies_of_their_own(tmp_path, monkeypatch):
    check_run(tmp_path, monkeypatch, 3)
