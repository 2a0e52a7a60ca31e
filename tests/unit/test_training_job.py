"""training.build_job: what a run's loaders are made of."""
from multigpu import setup, training
from multigpu.config import TrainConfig


def test_validation_starts_no_more_loader_workers_than_it_has_batches():
    """A 256-image validation set at batch 128 on 2 GPUs is one batch a rank: 15 persistent
    workers per rank would be 14 idle processes each, started and stopped for nothing."""
    rt = setup("single", "fp32", accelerator="cpu", seed=0)
    cfg = TrainConfig(model="mlp", data="synthetic:64", batch_size=32, workers=3)
    job = training.build_job(cfg, rt)
    assert job.train_loader.loader.num_workers == 3
    assert job.val_loader.loader.num_workers == 2  # 64 samples, 32 a batch
