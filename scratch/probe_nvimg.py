import io, time, sys
import numpy as np, torch
from PIL import Image
from nvidia import nvimgcodec as n

rng = np.random.default_rng(0)
def jpeg(w, h, mode="RGB", detailed=False, progressive=False):
    coarse = rng.uniform(0, 255, size=(6, 8, 3)).astype(np.uint8)
    pic = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC), dtype=np.float32)
    pic += rng.normal(0, 40 if detailed else 12, size=pic.shape)
    im = Image.fromarray(np.clip(pic, 0, 255).astype(np.uint8)).convert(mode)
    b = io.BytesIO(); im.save(b, format="JPEG", quality=90, progressive=progressive); return b.getvalue()

for kind in ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU", "CPU_ONLY"):
    try:
        d = n.Decoder(backends=[n.Backend(getattr(n, kind))])
        out = d.decode([n.CodeStream(jpeg(500, 375))])
        print(kind, "ok", out[0] and (out[0].shape, out[0].buffer_kind))
    except Exception as e:
        print(kind, "FAILED", type(e).__name__, e)
d = n.Decoder(backends=[n.Backend(n.HW_GPU_ONLY), n.Backend(n.GPU_ONLY)])
for name, data in [("gray", jpeg(300, 200, "L")), ("cmyk", jpeg(300, 200, "CMYK")), ("progressive", jpeg(300, 200, progressive=True)), ("trunc", jpeg(300,200)[:3000]), ("garbage", b"\xff\xd8hello")]:
    try:
        img = d.decode([n.CodeStream(data)], params=n.DecodeParams(color_spec=n.RGB))
        im = img[0]
        print(name, None if im is None else (im.shape, torch.as_tensor(im, device="cuda").float().mean().item()))
    except Exception as e:
        print(name, "EXC", type(e).__name__, str(e)[:200])
for detailed in (False, True):
    datas = [jpeg(500, 375, detailed=detailed) for _ in range(256)]
    print("size KB", sum(map(len, datas)) / len(datas) / 1024)
    for kind in ("HW_GPU_ONLY", "GPU_ONLY"):
        d = n.Decoder(backends=[n.Backend(getattr(n, kind))])
        s = torch.cuda.Stream()
        for rep in range(4):
            torch.cuda.synchronize(); t = time.perf_counter()
            with torch.cuda.stream(s):
                imgs = d.decode([n.CodeStream(x) for x in datas], cuda_stream=s.cuda_stream)
                ts = [torch.as_tensor(i, device="cuda") for i in imgs]
            s.synchronize(); dt = time.perf_counter() - t
        print(kind, "detailed" if detailed else "smooth", f"{len(datas)/dt:.0f} img/s", ts[0].shape, ts[0].dtype, ts[0].stride())
    from torchvision.io import decode_jpeg
    enc = [torch.frombuffer(bytearray(x), dtype=torch.uint8) for x in datas]
    for rep in range(4):
        torch.cuda.synchronize(); t = time.perf_counter()
        o = decode_jpeg(enc, device="cuda"); torch.cuda.synchronize(); dt = time.perf_counter() - t
    print("torchvision", f"{len(datas)/dt:.0f} img/s")
