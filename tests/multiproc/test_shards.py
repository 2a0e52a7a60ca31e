"""shards: data on 2 and 3 CPU processes through `multigpu run` and `multigpu train`: every sample
once an epoch, and a run stopped inside an epoch resumed exactly."""
import json
from pathlib import Path

import pytest
import torch

from multigpu.train.data import shard_pack
from tests.unit.test_shards import make_folder, write_shards

from .conftest import multigpu, read_metrics

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "lib_scripts" / "shards_resume.py"


def seen(out: Path, mode: str) -> list[str]:
    return [k for f in sorted(out.glob(f"{mode}-rank*.json")) for k in json.loads(f.read_text())]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return write_shards(make_folder(root / "imgs", per_class=6), root / "shards", per_shard=5)


def run(out: Path, shards: Path, mode: str, procs: int = 2):
    proc = multigpu("run", "--devices", f"cpu:{procs}", "--log-dir", out / f"logs-{mode}", SCRIPT,
                    shards, out, mode)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_a_run_stopped_mid_epoch_on_2_resumes_on_2_bit_identical_and_on_3_each_sample_once(tmp_path, shards):
    # 12 training images in 3 shards; global batch 4: 3 steps, stopped after 2 (8 images)
    run(tmp_path, shards, "full")
    every = seen(tmp_path, "full")
    assert len(every) == len(set(every)) == 12
    run(tmp_path, shards, "stop")
    stopped = seen(tmp_path, "stop")
    assert len(stopped) == 8
    run(tmp_path, shards, "resume")
    assert sorted(stopped + seen(tmp_path, "resume")) == sorted(every)
    full, resumed = (torch.load(tmp_path / f"{m}.pt", weights_only=True) for m in ("full", "resume"))
    assert all(torch.equal(full[k], resumed[k]) for k in full), "bit-identical to the unstopped run"
    for f in tmp_path.glob("resume-rank*.json"):
        f.unlink()
    run(tmp_path, shards, "resume", procs=3)  # the last 4 images over 3 processes
    assert sorted(stopped + seen(tmp_path, "resume")) == sorted(every), "every sample once"


@pytest.mark.extended  # one more launch (25 s here); the sampler is the one tested above
def test_train_on_shards_on_two_processes_trains_every_sample_once(tmp_path, shards):
    proc = multigpu("train", "--model", "cnn", "--data", f"shards:{shards}", "--image-size", "8",
                    "--epochs", "1", "--batch-size", "2", "--devices", "cpu:2", "--workers", "1",
                    "--logger", "none", "--out", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"cnn on shards:{shards} (12 train / 12 val)" in proc.stdout
    assert read_metrics(tmp_path / "run")[0]["train_samples"] == 12


@pytest.mark.parametrize("splitter", ["none", pytest.param("split_by_node", marks=pytest.mark.extended)])
def test_auto_splits_a_script_s_own_webdataset_pipeline_every_sample_once(tmp_path, shards, splitter):
    """webdataset's pipeline over the training shards multigpu pack wrote (keys without dots,
    which webdataset's reader would cut at the first): with nodesplitter=None every process reads
    them all and --auto keeps its positions; with split_by_node each rank reads its own shards,
    and --auto pools what lies past the shortest stream."""
    packed = tmp_path / "packed"
    shard_pack.pack(str(shards.parent / "imgs"), packed, shard_size=9000)
    assert len(list(packed.glob("train-*.tar"))) == 7  # split_by_node: 4 on rank 0, 3 on rank 1
    script = Path(__file__).parent / "scripts" / "auto_webdataset_train.py"
    proc = multigpu("run", "--auto", "--devices", "cpu:2", script, packed, splitter, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"seen_rank{r}.json").read_text()) for r in (0, 1)]
    assert len(seen[0]) == len(seen[1]) and all(batch for s in seen for batch in s)
    keys = [k for s in seen for batch in s for k in batch]
    assert len(keys) == len(set(keys)) == 12, "every sample of the shards once"
