"""GPU tier for crop_resize's variants: in half precision on the GPU, each makes PIL's crops (the
CPU path's) as on the CPU (tests/unit/test_crop_resize.py), at the training size.

Run on a machine with a GPU and torchvision:  pytest -m gpu tests/gpu/test_crop_resize_gpu.py -s
"""
import pytest
import torch

from multigpu.train.data import crop_resize
from tests.unit.test_crop_resize import PIL_WEIGHTS, pictures_and_crops, pil_crops

GPU = torch.device("cuda", 0)
SIZE = 224
pytestmark = [pytest.mark.gpu, pytest.mark.cuda_here,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("variant", PIL_WEIGHTS)
def test_each_variant_makes_pils_crops_to_a_level_in_half_precision(variant):
    pictures, tensors, boxes, flips = pictures_and_crops(count=24)
    tensors = [t.to(GPU) for t in tensors]
    ours = crop_resize.VARIANTS[variant](tensors, boxes, flips, SIZE)
    assert ours.device == tensors[0].device and ours.shape == (24, 3, SIZE, SIZE)
    diff = (ours.round().cpu() - pil_crops(pictures, boxes, flips, SIZE)).abs()
    print(f"{variant} vs PIL: mean {diff.mean():.3f}, max {diff.max():.0f}")
    assert diff.max() <= 1 and diff.mean() < 0.25
    product = crop_resize.crop_resize_padded(tensors, boxes, flips, SIZE)
    assert (ours - product).abs().max() < 0.5
