"""training.build_job: what a run's loaders are made of."""

import pytest

from multigpu import setup
from multigpu.train import training
from multigpu.train.settings.config import TrainConfig


def test_validation_starts_no_more_loader_workers_than_it_has_batches():
    """A 256-image validation set at batch 128 on 2 GPUs is one batch a rank: 15 persistent
    workers per rank would be 14 idle processes each, started and stopped for nothing."""
    rt = setup("single", "fp32", accelerator="cpu", seed=0)
    cfg = TrainConfig.from_flat(model="mlp", data="synthetic:64", batch_size=32, workers=3)
    job = training.build_job(cfg, rt)
    assert job.train_loader.loader.num_workers == 3
    assert job.val_loader.loader.num_workers == 2  # 64 samples, 32 a batch


def test_the_start_up_is_marked_part_by_part_and_folder_data_names_its_decoder(tmp_path):
    """The `time:` line's parts come from these marks: a GPU run's slow part is then named, not
    guessed (a 25 600-file folder's "data" took 3.3-4.3 s on 2x H200, run 19)."""
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / split / cls).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / split / cls / "0.png")
    rt = setup("single", "fp32", accelerator="cpu", seed=0)
    for data, first in (("synthetic:64", []), (f"folder:{tmp_path}", ["decoder"])):
        marks = []
        training.build_job(TrainConfig.from_flat(model="cnn", data=data, batch_size=2, workers=0, image_size=8), rt,
                           mark=marks.append)
        assert marks == [*first, "data", "model", "prepare", "optimizer"], data


def test_with_a_head_start_the_job_takes_the_thread_s_data_and_marks_no_decoder(tmp_path):
    """The decoder and the listing were the thread's (head_start.py): the run's own "data" part
    is its wait for them, and the data it trains on is what the thread loaded."""
    from multigpu.train.head_start import HeadStart
    from tests.unit.test_datasets import make_image_folder

    make_image_folder(tmp_path, per_class=2)
    rt = setup("single", "fp32", accelerator="cpu", seed=0)
    cfg = TrainConfig.from_flat(model="cnn", data=f"folder:{tmp_path}", batch_size=2, workers=0, image_size=8)
    head = HeadStart.begin(cfg, env={})
    marks = []
    job = training.build_job(cfg, rt, mark=marks.append, head=head)
    assert marks == ["data", "model", "prepare", "optimizer"]
    assert job.data is head.data()
    # the optimizer's compiler too, one process as well (its dependencies first)
    assert [part for part, _, _ in head.spans] == ["compiler's modules", "decoder", "folder listing", "compiler"]


@pytest.mark.parametrize("flags, device, tunes", [
    ({}, "cuda", True),  # the default: on
    ({"cudnn_benchmark": "off"}, "cuda", False),
    ({"deterministic": True}, "cuda", False),
    ({}, "cpu", False),
])
def test_cudnn_times_its_convolutions_on_gpus_unless_off_or_deterministic(flags, device, tunes):
    cfg = TrainConfig.from_flat(model="cnn", data="synthetic:64", **flags)
    assert training.cudnn_autotunes(cfg, device) is tunes
