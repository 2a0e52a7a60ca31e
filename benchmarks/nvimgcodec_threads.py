"""nvImageCodec on the hardware JPEG engines alone: images/s by host threads and output layout.

    PYTHONPATH=src python benchmarks/nvimgcodec_threads.py FOLDER    (its train/*/*.jpg, 2 560 at most)

Baseline and grey JPEGs only (what the engines take); batches of 256 on a side stream, each
setting the median of 3 passes. What set nvimgcodec_decoder.HOST_THREADS.
"""
import sys
import time
import glob
import statistics
import numpy as np
import torch

from nvidia import nvimgcodec as n
from PIL import Image

files = sorted(glob.glob(sys.argv[1] + "/train/*/*.jpg"))[:2560]
keep = []
for f in files:
    with Image.open(f) as im:
        if im.mode in ("RGB", "L") and not im.info.get("progressive"):
            keep.append(f)
datas = [np.fromfile(f, dtype=np.uint8) for f in keep]
print(len(datas), "files", sum(d.size for d in datas) / len(datas) / 1024, "KB")
dev = torch.device("cuda", 0)
s = torch.cuda.Stream()
def run(threads, fmt):
    d = n.Decoder(device_id=0, max_num_cpu_threads=threads, backends=[n.Backend(n.BackendKind.HW_GPU_ONLY)])
    p = n.DecodeParams(apply_exif_orientation=False, color_spec=n.ColorSpec.SRGB, sample_format=fmt)
    rates = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.cuda.stream(s):
            for i in range(0, len(datas) - 255, 256):
                srcs = [n.CodeStream(x) for x in datas[i:i + 256]]
                out = d.decode(srcs, params=p, cuda_stream=s.cuda_stream)
                [torch.from_dlpack(o) for o in out]
        s.synchronize()
        rates.append(len(datas) // 256 * 256 / (time.perf_counter() - t))
    return statistics.median(rates)
for threads in (4, 8, 16):
    for name, fmt in (("planar", n.SampleFormat.P_RGB), ("interleaved", n.SampleFormat.I_RGB)):
        print(f"threads {threads} {name}: {run(threads, fmt):.0f} img/s", flush=True)
