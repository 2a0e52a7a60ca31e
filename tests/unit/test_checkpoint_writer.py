"""The background writer's snapshot: copies that training can no longer change, in their layout."""
import torch

from multigpu.train.checkpoints.checkpoint_writer import BackgroundWriter, staging_buffer


def test_staging_buffers_keep_a_dense_layout_and_fall_back_to_contiguous():
    w = torch.randn(8, 3, 5, 5).to(memory_format=torch.channels_last)
    assert staging_buffer(w, pin_memory=False).stride() == w.stride()
    v = torch.randn(6)
    assert staging_buffer(v, pin_memory=False).stride() == (1,)
    sliced = torch.randn(4, 6)[:, ::2]  # not dense: a contiguous buffer
    assert staging_buffer(sliced, pin_memory=False).is_contiguous()


def test_the_write_sees_the_state_as_it_was_when_saved():
    weights = torch.zeros(1000)
    seen = []
    writer = BackgroundWriter()
    writer.save({"w": weights}, lambda copy: seen.append(copy["w"].clone()))
    weights += 1  # training goes on while the write runs
    writer.wait()
    writer.close()
    assert torch.equal(seen[0], torch.zeros(1000))


def test_a_failed_write_is_raised_at_the_next_save_or_wait():
    writer = BackgroundWriter()

    def fail(_):
        raise OSError(28, "No space left on device")
    writer.save({"w": torch.zeros(1)}, fail)
    writer._pending.exception()  # let it finish
    assert writer.failed
    try:
        writer.wait()
    except OSError as exc:
        assert exc.strerror == "No space left on device"
    else:
        raise AssertionError("the write's error was not raised")
    writer.close()


def test_an_os_error_names_its_file_only_where_it_has_one():
    from multigpu.core.errors import os_error_text

    assert os_error_text(OSError(28, "No space left on device")) == "No space left on device"
    assert os_error_text(OSError(13, "Permission denied", "/ckpt/x.pt")) == "Permission denied (/ckpt/x.pt)"
