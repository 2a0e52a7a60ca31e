"""crop_resize's variants make PIL's crops (the CPU path's: imagefolder._resize_box) to a level,
on detailed pictures of the generated folder's sizes with the training crop's boxes, flipped or
not, shrunk, enlarged and whole; and they agree with the product's variant to float rounding.
Here in float32 on the CPU; tests/gpu/test_crop_resize_gpu.py runs them in half on a GPU."""
import pytest
import torch

from multigpu.bench import imagegen
from multigpu.train.data import crop_resize, imagefolder

SIZE = 56
PIL_WEIGHTS = list(crop_resize.VARIANTS)


def pictures_and_crops(count=10, seed=0):
    """(PIL images, uint8 tensors, boxes, flips): detailed images (greys made RGB), the training
    crop's random boxes, and three set ones: an enlarged corner, the whole image, a thin strip."""
    generator = torch.Generator().manual_seed(seed)
    pictures = [imagegen.make_image("detailed", s).convert("RGB") for s in range(1, count + 1)]
    boxes = [imagefolder._random_box(p.width, p.height, generator) for p in pictures]
    boxes[:3] = [(5, 3, 20, 30), (0, 0, pictures[1].width, pictures[1].height), (40, 0, 9, pictures[2].height)]
    flips = [k % 3 == 1 for k in range(count)]
    tensors = [imagefolder._to_tensor(p) for p in pictures]
    return pictures, tensors, boxes, flips


def pil_crops(pictures, boxes, flips, size=SIZE) -> torch.Tensor:
    return torch.stack([imagefolder._to_tensor(imagefolder._resize_box(p, b, f, size))
                        for p, b, f in zip(pictures, boxes, flips, strict=True)]).float()


@pytest.mark.parametrize("variant", PIL_WEIGHTS)
def test_each_variant_makes_pils_crops_to_a_level(variant):
    pictures, tensors, boxes, flips = pictures_and_crops()
    ours = crop_resize.VARIANTS[variant](tensors, boxes, flips, SIZE)
    assert ours.shape == (len(tensors), 3, SIZE, SIZE) and ours.dtype == torch.float32
    # PIL rounds to uint8 between its two passes, the matrices do not: a level at most, and
    # that on a sixth of the pixels or fewer (a box or a flip off by one gives several levels).
    diff = (ours.round() - pil_crops(pictures, boxes, flips)).abs()
    assert diff.max() <= 1 and diff.mean() < 0.25
    product = crop_resize.crop_resize_padded(tensors, boxes, flips, SIZE)
    assert (ours - product).abs().max() < 1e-3


def test_the_product_uses_the_banded_weights():
    _, tensors, boxes, flips = pictures_and_crops(count=4)
    assert torch.equal(crop_resize.crop_resize(tensors, boxes, flips, SIZE),
                       crop_resize.crop_resize_padded_band(tensors, boxes, flips, SIZE))


def test_banded_weights_are_the_dense_ones():
    """Each axis's weights, flipped or not, shrinking and enlarging, cut by the window's edge."""
    start = torch.tensor([3.0, -0.0, 10.5, 0.0], dtype=torch.float64)
    length = torch.tensor([300.0, 20.0, 7.0, 97.0], dtype=torch.float64)
    extent = torch.tensor([305.0, 22.0, 19.0, 99.0], dtype=torch.float64)
    flip = torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    dense = crop_resize._weights(start, length, extent, SIZE, 320)
    dense = torch.where(flip.bool().view(-1, 1, 1), dense.flip(1), dense)
    taps = crop_resize._taps([300, 20, 7, 97], SIZE)
    band = crop_resize._band_weights(start, length, extent, (SIZE, 320, taps), flip, torch.float32)
    assert band.shape == dense.shape
    assert (band - dense).abs().max() < 1e-6
    assert torch.allclose(band.sum(-1), torch.ones(4, SIZE))
