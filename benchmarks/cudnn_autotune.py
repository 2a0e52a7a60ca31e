"""What cuDNN's autotuning (torch.backends.cudnn.benchmark, which `multigpu train` turns on for a
GPU run) costs at the first step and gives back in the steady state, for one model, each setting
in a fresh process, settings in turns.

    python benchmarks/cudnn_autotune.py --rounds 2 --out /tmp/cudnn.jsonl

A setting is `off`, `on` (torch's default benchmark_limit, 10 algorithms) or `onN` (benchmark_limit
N). Each process: the model (multigpu's built-in of --model) in bf16 autocast and channels_last on
cuda:0, fused AdamW, a synthetic batch on the GPU; the first step's seconds (synchronised), then
--trials trials of --steps steps, whose median gives the steady state's ms a step. One JSON line per
process to --out; the medians per setting are printed.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time


def child(a) -> None:
    import torch

    from multigpu.train.models.catalog import build_model

    torch.backends.cudnn.benchmark = a.setting != "off"
    if a.setting.startswith("on") and a.setting != "on":
        torch.backends.cudnn.benchmark_limit = int(a.setting[2:])
    device = torch.device("cuda", 0)
    model = build_model(a.model, (3, 224, 224), 1000).to(device, memory_format=torch.channels_last)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(a.batch_size, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (a.batch_size,), device=device)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.synchronize()
    began = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - began
    for _ in range(5):
        step()
    trials = []
    for _ in range(a.trials):
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
        trials.append((time.perf_counter() - began) / a.steps * 1000)
    print(json.dumps({"setting": a.setting, "first_step_s": round(first, 2),
                      "step_ms": round(statistics.median(trials), 2), "trials_ms": [round(t, 2) for t in trials],
                      "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
                      "gpu": torch.cuda.get_device_name(0)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--settings", default="off,on,on1")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--out")
    p.add_argument("--setting", help=argparse.SUPPRESS)  # the child's
    a = p.parse_args()
    if a.setting:
        return child(a)
    rows = []
    for _ in range(a.rounds):
        for setting in a.settings.split(","):
            done = subprocess.run([sys.executable, __file__, "--setting", setting, "--model", a.model,
                                   "--batch-size", str(a.batch_size), "--steps", str(a.steps),
                                   "--trials", str(a.trials)], capture_output=True, text=True)
            line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
            row = json.loads(line) if line.startswith("{") else {"setting": setting, "error": done.stderr[-400:]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    for setting in a.settings.split(","):
        ok = [r for r in rows if r["setting"] == setting and "step_ms" in r]
        if ok:
            print(f"{setting:6s} first step {statistics.median(r['first_step_s'] for r in ok):.2f} s, "
                  f"steady {statistics.median(r['step_ms'] for r in ok):.2f} ms a step ({len(ok)} runs)")


if __name__ == "__main__":
    main()
