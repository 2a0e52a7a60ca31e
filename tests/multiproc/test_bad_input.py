"""Every error of the README's table "When something is wrong", run as the table says.

The table is the one list: each row's command runs here (in-process through `multigpu.cli.main`,
in a folder holding the files the rows name), and must give its message, as one line on stderr
with no traceback, its exit status, and leave nothing behind in the folder.
"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch

from multigpu import cli

pytestmark = [pytest.mark.slow, pytest.mark.smoke]  # in-process: seconds in all

README = Path(__file__).resolve().parents[2] / "README.md"


def table_rows() -> list[tuple[str, str, int]]:
    text = README.read_text()
    block = text.split("<!-- errors: begin -->")[1].split("<!-- errors: end -->")[0]
    rows = []
    for line in block.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        command, message, code = (c.strip("`") for c in cells)
        rows.append((command, message.rstrip("…").replace("\\|", "|"), int(code)))
    return rows


class Evil:
    def __reduce__(self):
        import os
        return (os.system, ("touch PWNED",))


def make_files(folder: Path) -> None:
    """The files the table's commands name."""
    from PIL import Image

    (folder / "rand.pt").write_bytes(bytes(range(256)) * 20)
    (folder / "empty.pt").write_bytes(b"")
    torch.save({"model": Evil()}, folder / "evil.pt")
    torch.save({"w": torch.zeros(1000)}, folder / "good.pt")
    data = (folder / "good.pt").read_bytes()
    (folder / "trunc.pt").write_bytes(data[: len(data) // 2])
    (folder / "good.pt").unlink()
    (folder / "mine").mkdir()
    (folder / "mine" / "notes.txt").write_text("mine")
    (folder / "runs" / "earlier").mkdir(parents=True)  # a run of before: runs/ exists already
    (folder / "runs" / "earlier" / "config.json").write_text("{}")
    (folder / "text.csv").write_text("a,b\n1,x\n2,3\n")
    (folder / "short.csv").write_text("a,b\n1,2\n3,4\n")
    (folder / "crlf.sh").write_bytes(b"#!/bin/bash\r\necho hi\r\n")
    (folder / "train.py").write_text("print('hi')\n")
    (folder / "typo.yaml").write_text("model: mlp\nbatch_sise: 8\n")
    (folder / "type.yaml").write_text("model: mlp\nepochs: three\n")
    for split in ("train", "val"):
        (folder / "one" / split / "cat").mkdir(parents=True)
        Image.new("RGB", (16, 16)).save(folder / "one" / split / "cat" / "a.jpg")
        for cls in ("cat", "dog"):
            (folder / "broken" / split / cls).mkdir(parents=True)
            for i in range(2):
                Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(folder / "broken" / split / cls / f"{i}.jpg")
    (folder / "broken" / "train" / "cat" / "0.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("bad-input")
    make_files(folder)
    return folder


def run(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command,message,code", table_rows(),
                         ids=lambda v: v if isinstance(v, str) and v.startswith("multigpu") else "")
def test_each_error_of_the_table(files, monkeypatch, capsys, command, message, code):
    monkeypatch.chdir(files)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the table is written for a machine without GPUs
    before = sorted(p.relative_to(files) for p in files.rglob("*"))
    status, err = run(shlex.split(command)[1:], capsys)
    assert (status, message) == (code, message) and message in err, err
    assert "Traceback" not in err and "usage:" not in err  # no argparse usage block either
    errors = [line for line in err.splitlines() if line.startswith("multigpu") and "error:" in line]
    assert len(errors) == 1 and message in errors[0], f"the message is one line: {err}"
    assert sorted(p.relative_to(files) for p in files.rglob("*")) == before, "nothing left behind"


def test_the_table_covers_the_faults_of_the_issue():
    commands = " ".join(c for c, _, _ in table_rows())
    for case in ("--lr nan", "rand.pt", "evil.pt", "folder:one", "--bad-images fail", "trunc.pt"):
        assert re.search(re.escape(case), commands), case
