"""The shared training step's input handling."""
import torch

from multigpu.datasets import IMAGENET_MEAN, IMAGENET_STD
from multigpu.engine import StepSettings, prepare_inputs


def test_uint8_images_are_normalised_on_the_device_like_the_float_pipeline():
    x = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    settings = StepSettings.for_data((IMAGENET_MEAN, IMAGENET_STD), torch.device("cpu"),
                                     channels_last=True)
    out = prepare_inputs(x, settings)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, (x.float() / 255 - mean) / std)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)


def test_float_inputs_pass_through_untouched():
    x = torch.randn(2, 3, 4, 4)
    assert prepare_inputs(x, StepSettings()) is x


def test_out_of_memory_message_names_the_cause_and_three_fixes(monkeypatch):
    from types import SimpleNamespace

    from multigpu.config import TrainConfig
    from multigpu.training import _oom_message

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=80 * 2**30))
    rt = SimpleNamespace(device=torch.device("cuda", 1), precision=SimpleNamespace(kind="fp32"))
    message = _oom_message(TrainConfig(model="resnet50", batch_size=256), rt)
    assert message.startswith("CUDA out of memory on cuda:1 (80 GiB) with --batch-size 256 per GPU")
    assert "--batch-size 128" in message and "--accumulate 2" in message
    assert "--precision bf16" in message and "\n" not in message
