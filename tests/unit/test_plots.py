"""curves.png is written whole, through core.fileio's temporary names: no file of a fixed name
beside it is taken over."""
import json

import pytest
from PIL import Image

pytest.importorskip("matplotlib")

from multigpu.train.rundir import plots, runfolder  # noqa: E402 (after the skip without matplotlib)


def test_curves_png_is_whole_and_a_file_beside_it_is_left_as_it_was(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    epochs = [{"epoch": e, "step": 4 * e, "train_loss": 1.0 / e, "val_loss": 1.2 / e,
               "val_accuracy": 50.0 + e} for e in (1, 2)]
    (run / runfolder.METRICS).write_text("".join(json.dumps(e) + "\n" for e in epochs))
    mine = run / ".curves.png.tmp.png"  # the temporary name plots used to write through
    mine.write_text("the user's")
    assert plots.draw([run], run / plots.CURVES) == run / plots.CURVES
    with Image.open(run / plots.CURVES) as png:
        assert png.format == "PNG" and png.size[0] > 0
    assert mine.read_text() == "the user's"
    assert sorted(p.name for p in run.iterdir()) == [".curves.png.tmp.png", "curves.png",
                                                     runfolder.METRICS]
