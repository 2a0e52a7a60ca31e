"""What `multigpu test` runs on every device: the checks of the self-test, one process per device.

    python -P -m multigpu.launcher.rank.worker -m multigpu.doctor.selftest --result FILE [--checkpoint-dir DIR]

Started by the real launcher (`multigpu test` builds the same command as `multigpu run -m`). Every
rank runs every check and records (check, status, detail); a check that fails records its cause
in one line and the next check still runs. At the end the ranks gather their records, rank 0
prints one table and writes the verdict to FILE (JSON) for the command to turn into its exit
status. Workers exit 0 whenever the checks ran to the end, failed or not, so the launcher does not
report a crashed rank for a failed check.

The checks use the library's real path: `setup()`, `prepare()`, `backward()`/`step()`,
`save()`/`load()`, `Precision`; the collectives are torch.distributed's, on the device.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
import warnings
from pathlib import Path

OK, FAIL, SKIP = "ok", "FAIL", "skip"
TRAIN_STEPS = 6


class CheckFailed(Exception):
    """A check saw a wrong value; the message says what was expected and what came."""


class Skipped(Exception):
    """The check does not apply here (one process, no bf16 on this GPU); the message says why."""


def run_check(results: list, name: str, check, *args):
    """Run one check, record its outcome; returns its value (None when it did not pass)."""
    try:
        detail, value = check(*args)
    except Skipped as exc:
        results.append((name, SKIP, str(exc)))
        return None
    except Exception as exc:  # any cause, as one line: the table shows it, not a traceback
        results.append((name, FAIL, cause(exc)))
        return None
    results.append((name, OK, detail))
    return value


def cause(exc: BaseException) -> str:
    """An exception as one line. Our own messages (CheckFailed, rt.save's RuntimeError, a
    UsageError) say everything; others keep their type, which is often the cause (OSError)."""
    from multigpu.core.errors import UsageError

    text = (str(exc).strip().splitlines() or [""])[0]
    if type(exc) in (CheckFailed, RuntimeError) or isinstance(exc, UsageError):
        return text or type(exc).__name__
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- the checks

def check_process_group(rt):
    import torch.distributed as dist

    env = rt.env
    if not env.is_distributed:
        return f"one process on {env.device}: no process group needed", env
    seen = env.all_gather_object((env.rank, env.local_rank, str(env.device), socket.gethostname()))
    ranks = [r for r, *_ in seen]
    if ranks != list(range(env.world_size)) or dist.get_world_size() != env.world_size:
        raise CheckFailed(f"ranks {ranks} for world size {env.world_size}: "
                          f"expected 0..{env.world_size - 1}")
    devices = ", ".join(sorted({d for _, _, d, _ in seen}))
    hosts = len({h for *_, h in seen})
    return (f"{env.backend}, world size {env.world_size}, ranks 0..{env.world_size - 1} on "
            f"{devices} ({hosts} host{'s' if hosts > 1 else ''})"), env


def _needs_group(env) -> None:
    if not env.is_distributed:
        raise Skipped("one process: nothing to exchange")


def check_all_reduce(env):
    import torch

    _needs_group(env)
    w = env.world_size
    t = torch.full((1024,), float(env.rank + 1), device=env.device)
    env.all_reduce(t, "sum")
    m = env.all_reduce(torch.tensor([float(env.rank)], device=env.device), "max")
    want = w * (w + 1) / 2
    if not bool((t == want).all()) or m.item() != w - 1:
        raise CheckFailed(f"all_reduce gave sum {t[0].item():g} and max {m.item():g}, "
                          f"expected {want:g} and {w - 1}")
    return f"sum of rank+1 = {want:g}, max of rank = {w - 1}", None


def check_broadcast(env):
    import torch
    import torch.distributed as dist

    _needs_group(env)
    want = torch.arange(257, dtype=torch.float32, device=env.device)
    t = want.clone() if env.rank == 0 else torch.zeros_like(want)
    dist.broadcast(t, src=0)
    if not torch.equal(t, want):
        raise CheckFailed(f"rank {env.rank} got a different tensor from rank 0 "
                          f"({int((t != want).sum())} of {want.numel()} values differ)")
    return f"rank 0's {want.numel()} values on every rank", None


def check_all_gather(env):
    import torch
    import torch.distributed as dist

    _needs_group(env)
    parts = [torch.empty(3, device=env.device) for _ in range(env.world_size)]
    dist.all_gather(parts, torch.full((3,), float(env.rank), device=env.device))
    got = [p[0].item() for p in parts]
    whole = all(len(set(p.tolist())) == 1 for p in parts)  # no part mixed from several ranks
    if got != [float(r) for r in range(env.world_size)] or not whole:
        raise CheckFailed(f"all_gather gave {got}, expected {list(range(env.world_size))}")
    return f"{env.world_size} parts in rank order", None


def check_barrier(env):
    _needs_group(env)
    start = time.perf_counter()
    env.barrier()
    return f"every rank passed ({(time.perf_counter() - start) * 1000:.0f} ms)", None


def _tiny_problem(rt):
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1 * torch.randn(256, 1, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(TensorDataset(x, y), batch_size=32 // rt.world_size or 1, shuffle=True)
    return model, optimizer, loader


def weights_digest(model) -> str:
    import torch

    h = hashlib.sha256()
    for p in model.state_dict().values():
        h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def check_ddp_training(rt):
    import torch

    model, optimizer, loader = _tiny_problem(rt)
    model, optimizer, loader = rt.prepare(model, optimizer, loader)
    model.train()
    losses = []
    for step, (x, y) in enumerate(loader):
        if step == TRAIN_STEPS:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        rt.backward(loss)
        rt.step(optimizer)
        losses.append(loss.item())
    first, last = losses[0], losses[-1]
    if not all(map(math.isfinite, losses)) or not last < first:
        raise CheckFailed(f"the loss went from {first:.4g} to {last:.4g} in {len(losses)} steps; "
                          "expected it finite and lower")
    digests = rt.env.all_gather_object(weights_digest(rt.strategy.unwrap(model)))
    if len(set(digests)) != 1:
        raise CheckFailed(f"weights differ across ranks after {len(losses)} steps: "
                          + ", ".join(f"rank {r} {d}" for r, d in enumerate(digests)))
    ranks = f"{rt.world_size} rank{'s' if rt.world_size > 1 else ''}"
    return (f"{rt.strategy.name}, {len(losses)} steps, loss {first:.3f} -> {last:.3f}, weights "
            f"equal on {ranks} (sha256 {digests[0]})",
            (model, optimizer))


def check_checkpoint(rt, trained, checkpoint_dir: str | None):
    if trained is None:
        raise Skipped("no trained model (the training check failed)")
    model, optimizer = trained
    folder = checkpoint_dir or _shared_temp_folder(rt)
    path = Path(folder) / f"selftest-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}.pt"
    try:
        return _round_trip(rt, model, optimizer, path), None
    finally:
        rt.env.barrier()  # every rank has read the file before it goes
        if rt.is_main:
            with contextlib.suppress(OSError):  # the cause, if any, is the check's own error
                path.unlink(missing_ok=True)
            if checkpoint_dir is None:
                shutil.rmtree(folder, ignore_errors=True)


def _shared_temp_folder(rt) -> str:
    """A new temporary folder made by rank 0, its name sent to every rank; when rank 0 cannot
    make it, every rank raises its cause (rather than waiting for a name that never comes)."""
    made = None
    if rt.is_main:
        try:
            made = (tempfile.mkdtemp(prefix="multigpu-test-"), None)
        except OSError as exc:
            made = (None, f"no temporary folder for the checkpoint on rank 0: {cause(exc)}")
    folder, error = rt.env.broadcast_object(made)
    if error:
        raise CheckFailed(error)
    return folder


def _round_trip(rt, model, optimizer, path: Path) -> str:
    import torch

    rt.save(path, model=model, optimizer=optimizer, step=TRAIN_STEPS)
    fresh, fresh_opt, _ = _tiny_problem(rt)
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh, fresh_opt = rt.prepare(fresh, fresh_opt)
    state = rt.load(path, model=fresh, optimizer=fresh_opt)
    want, got = weights_digest(rt.strategy.unwrap(model)), weights_digest(rt.strategy.unwrap(fresh))
    if got != want:
        raise CheckFailed(f"weights loaded from {path} differ from those saved ({got} != {want})")
    if state.get("step") != TRAIN_STEPS or len(fresh_opt.state_dict()["state"]) != len(
            optimizer.state_dict()["state"]):
        raise CheckFailed(f"{path}: the step ({state.get('step')}) or the optimizer state did not "
                          "come back")
    size = path.stat().st_size if rt.is_main else 0
    temporary = path.parent.name.startswith("multigpu-test-")
    where = "a temporary folder" if temporary else str(path.parent)
    return f"rt.save/rt.load in {where}: weights, optimizer and step back ({size / 1024:.1f} KiB)"


def check_autocast(rt, kind: str):
    import torch
    from torch import nn

    from multigpu.core.errors import UsageError
    from multigpu.core.precision import Precision

    try:
        precision = Precision(kind, rt.device)
    except UsageError as exc:
        raise Skipped(str(exc)) from None
    model = nn.Linear(16, 4).to(rt.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    x = torch.randn(8, 16, device=rt.device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with precision.autocast():
            out = model(x)
    disabled = [str(w.message) for w in caught if "autocast" in str(w.message).lower()]
    if disabled:
        raise Skipped(f"not on {rt.device.type}: {disabled[0].splitlines()[0]}")
    if out.dtype != precision.dtype:
        raise CheckFailed(f"autocast to {kind} gave {out.dtype}, expected {precision.dtype}")
    precision.backward(out.float().pow(2).mean())
    precision.optimizer_step(optimizer)
    if not torch.isfinite(model.weight).all() or torch.equal(model.weight, before):
        raise CheckFailed(f"the {kind} step left the weights unchanged or not finite")
    scaler = ", loss scaling" if precision.scaler is not None else ""
    return f"matmul in {out.dtype}{scaler}, one step on {rt.device.type}", None


# --------------------------------------------------------------------------- the report

def merge(per_rank: list[list[tuple[str, str, str]]]) -> list[tuple[str, str, str]]:
    """One row per check over every rank: FAIL when any rank failed (with the first failing
    rank's cause), skip when every rank skipped, else ok with rank 0's detail."""
    rows = []
    for i, (name, _, detail) in enumerate(per_rank[0]):
        outcomes = [r[i] if i < len(r) else (name, FAIL, "no result") for r in per_rank]
        failed = [(rank, d) for rank, (_, s, d) in enumerate(outcomes) if s == FAIL]
        if failed:
            ranks = [rank for rank, d in failed if d == failed[0][1]]
            who = (f"rank {ranks[0]}" if len(ranks) == 1 else
                   "every rank" if len(ranks) == len(per_rank) else f"ranks {ranks}")
            text = f"{who}: {failed[0][1]}" if len(per_rank) > 1 else failed[0][1]
            rows.append((name, FAIL, text))
        elif all(s == SKIP for _, s, _ in outcomes):
            rows.append((name, SKIP, detail))
        else:
            rows.append((name, OK, detail))
    return rows


def format_table(rows: list[tuple[str, str, str]]) -> str:
    width = max(len("check"), *(len(name) for name, _, _ in rows))
    lines = [f"{'check':<{width}}  {'result':<6}  detail"]
    lines += [f"{name:<{width}}  {status:<6}  {detail}" for name, status, detail in rows]
    return "\n".join(lines)


def run_all(args) -> list[tuple[str, str, str]]:
    import multigpu
    from multigpu.core.distributed import init_distributed

    results: list = []

    def start():
        init_distributed(timeout_minutes=args.timeout_minutes,  # a short timeout for a test
                         install_hooks=True)
        return "", multigpu.setup("auto", "fp32", seed=0)

    rt = run_check(results, "setup", start)
    if rt is None:
        return results
    results.pop()  # `process group` reports the setup that worked
    run_check(results, "process group", check_process_group, rt)
    for name, check in [("all_reduce", check_all_reduce), ("broadcast", check_broadcast),
                        ("all_gather", check_all_gather), ("barrier", check_barrier)]:
        run_check(results, name, check, rt.env)
    trained = run_check(results, "DDP training", check_ddp_training, rt)
    if not all(rt.env.all_gather_object(trained is not None)):  # the next check is collective
        trained = None
    run_check(results, "checkpoint", check_checkpoint, rt, trained, args.checkpoint_dir)
    for kind in ("bf16", "fp16"):
        run_check(results, f"autocast {kind}", check_autocast, rt, kind)
    per_rank = rt.env.all_gather_object(results)
    return merge(per_rank)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="multigpu.doctor.selftest")
    p.add_argument("--result", required=True, help="rank 0 writes the verdict here (JSON)")
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--timeout-minutes", type=float, default=2.0)
    args = p.parse_args(argv)
    begin = time.perf_counter()
    rows = run_all(args)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    from multigpu.core.system.fileio import atomic_write_text

    import torch

    passed = all(status != FAIL for _, status, _ in rows)
    world = os.environ.get("WORLD_SIZE", "1")
    print(f"multigpu self-test: {world} process{'es' if world != '1' else ''}, torch "
          f"{torch.__version__}, {time.perf_counter() - begin:.1f} s in the workers\n"
          + format_table(rows), flush=True)
    atomic_write_text(args.result, json.dumps({"passed": passed, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
