"""What the GPU input path's thread costs a training step on one GPU.

    PYTHONPATH=src python benchmarks/gpu_path_contention.py FOLDER     (a folder: data set, e.g. one
        made by benchmarks/decode_pipeline.py --make DIR --kind detailed)

ResNet-50 (bf16, channels_last, SGD, batch 128, synthetic batch) steps are timed alone, then with a
thread on a side stream doing one part of `--decode gpu`'s work without pause: nvImageCodec's
decode, torchvision's decode, the crops alone (gpu_images.crop_resize on decoded images), and the
whole decode_batch. The thread runs faster than the step needs (its rate is printed beside what
the step consumes), so the slowdown is an upper bound for that part.

resnet50_step, time_steps and with_thread are imported by benchmarks/crop_resize_cost.py, resnet50_parts
by benchmarks/finish_under_load.py.
"""
import sys
import time
import threading
import torch


def resnet50_step(dev, batch=128):
    """One ResNet-50 training step (bf16 autocast, channels_last, SGD) on a fixed synthetic batch."""
    return resnet50_parts(dev, batch)[1]


def resnet50_parts(dev, batch=128, keep_grads=False):
    """(the fixed input batch, step()): resnet50_step's, the input exposed to be written in place;
    keep_grads zeroes the gradients in place instead of dropping them (as a captured graph needs)."""
    import torchvision

    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50().to(dev, memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(batch, 3, 224, 224, device=dev).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=dev)

    def step():
        with torch.autocast("cuda", torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=not keep_grads)
    return x, step


def time_steps(step, n=40):
    """Milliseconds a step, over n steps, synchronised at both ends."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1000


def with_thread(work, measure, dev, side, images_per_call=128):
    """(measure(), images a second the thread did): measure runs while a thread calls work(k),
    k = 0, 1, ..., on stream `side` without pause (synchronising the side stream after each)."""
    stop = threading.Event()
    done = [0]
    def loop():
        with torch.cuda.device(dev), torch.cuda.stream(side):
            k = 0
            while not stop.is_set():
                work(k)
                side.synchronize()
                done[0] += 1
                k += 1
    t = threading.Thread(target=loop)
    t.start()
    try:
        time.sleep(0.5)
        start_done = done[0]
        t0 = time.perf_counter()
        result = measure()
        rate = (done[0] - start_done) * images_per_call / (time.perf_counter() - t0)
    finally:
        stop.set()
        t.join()
    return result, rate


def main():
    from multigpu.train.data import gpu_images, imagefolder, jpeg_decoders

    dev = torch.device("cuda", 0)
    step = resnet50_step(dev)
    train = imagefolder.load_folder(sys.argv[1], 224).train
    train.on_gpu = True
    samples = [train[i][0] for i in range(1024)]
    samples = [s for s in samples if isinstance(s, gpu_images.EncodedImage)]
    batches = [gpu_images.ImageBatch(samples[i:i + 128]) for i in range(0, len(samples) - 127, 128)]
    files = [b.encoded() for b in batches]
    side = torch.cuda.Stream(dev)
    nv = jpeg_decoders.choose(dev)
    print("decoder", nv.name)
    tv = jpeg_decoders.TorchvisionDecoder()
    with torch.cuda.stream(side):
        decoded = [nv.decode(f, dev) for f in files]
    torch.cuda.synchronize()

    n = len(batches)
    def work_nv(k): nv.decode(files[k % n], dev)
    def work_tv(k): tv.decode(files[k % n], dev)
    def work_crops(k):
        b = batches[k % n]
        gpu_images.crop_resize(decoded[k % n], b.boxes, b.flips, 224)
    def work_full(k): gpu_images.decode_batch(batches[k % n], 224, dev, None)

    for _ in range(15):
        step()
    for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
        print(f"round {rnd}: alone {time_steps(step):.1f} ms/step", flush=True)
        for name, work in (("nvimgcodec decode", work_nv), ("torchvision decode", work_tv), ("crops only", work_crops),
                           ("decode_batch (nvimgcodec + crops)", work_full)):
            ms, rate = with_thread(work, lambda: time_steps(step), dev, side)
            print(f"  {name}: step {ms:.1f} ms; the thread {rate:.0f} img/s "
                  f"(the step needs {128000/ms:.0f})", flush=True)


if __name__ == "__main__":
    main()
