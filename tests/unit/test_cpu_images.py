"""folder: images decoded by the loader workers (--decode cpu): how a batch is put together and
sent, with the samples unchanged and each once an epoch (benchmarks/cpu_pipeline.py measures it)."""
import torch
from torch.utils.data import DataLoader

from multigpu.core.loading.loaders import PerSampleSeed, shard_loader
from multigpu.train.data import gpu_images
from tests.unit.test_gpu_images import folder_data, make_folder

CPU = torch.device("cpu")


class Probe:
    """The dataset's collate, saying from inside the worker whether the batch it made is in
    shared memory (a batch that is not gets copied there to be sent)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, samples):
        images, labels = self.collate(samples)
        return images, labels, torch.tensor([images.is_shared(), labels.is_shared()])


def test_a_workers_batch_is_made_in_shared_memory_and_equals_the_stacked_samples(tmp_path):
    train = folder_data(make_folder(tmp_path)).train
    loader = DataLoader(train, batch_size=4, num_workers=1, collate_fn=Probe(train.collate))
    torch.manual_seed(0)
    batches = list(loader)
    assert [b[2].tolist() for b in batches] == [[True, True]] * 3
    one = [train[i] for i in range(4)]  # outside a worker: a plain batch, as gpu_images made it
    images, labels = train.collate(one)
    assert not images.is_shared()
    want_images, want_labels = gpu_images.collate(one)
    assert torch.equal(images, want_images) and torch.equal(labels, want_labels)
    assert images.dtype == torch.uint8 and labels.dtype == torch.int64 and labels.shape == (4,)


def test_two_workers_give_every_sample_once_an_epoch_as_a_seeded_sample_is_made(tmp_path):
    train = folder_data(make_folder(tmp_path, per_class=9)).train  # 18 images
    loader = DataLoader(train, batch_size=4, shuffle=True, num_workers=2, collate_fn=train.collate,
                        persistent_workers=True)
    prepared = shard_loader(loader, layout=(1, 0, 1), device=CPU, seed=5,
                            on_step=lambda info: None)
    seeded = PerSampleSeed(train, 5)
    for epoch in range(2):
        want = {seeded[(epoch, i)][0].numpy().tobytes(): seeded[(epoch, i)][1].item()
                for i in range(len(train))}
        got = [(x.numpy().tobytes(), int(y)) for images, labels in prepared
               for x, y in zip(images, labels)]
        assert len(got) == 18 and len({g for g, _ in got}) == 18
        assert dict(got) == want
