"""GPU tier for the core: dp and ddp on 2 GPUs, fp16 and bf16, DataParallel wrapping order.

Run on a machine with 2+ GPUs:  make test-gpu   (pytest -m gpu tests/gpu)
"""
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import multigpu
from tests.multiproc.conftest import multigpu as run_multigpu, read_metrics

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


def _train(tmp_path, name, *args):
    out = tmp_path / name
    proc = run_multigpu("train", "--data", "digits", "--epochs", "3", "--out", out, *args)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    return out, proc


def test_dp_on_two_gpus_trains_every_sample(tmp_path):
    out, proc = _train(tmp_path, "dp", "--model", "cnn", "--strategy", "dp", "--devices", "0,1")
    records = read_metrics(out)
    assert [r["train_samples"] for r in records] == [1442] * 3
    assert records[-1]["val_samples"] == 355 and records[-1]["val_accuracy"] > 0.9
    assert json.loads((out / "config.json").read_text())["strategy"] == "dp"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_ddp_on_two_gpus_in_mixed_precision(tmp_path, precision):
    out, _ = _train(tmp_path, precision, "--model", "cnn", "--devices", "2",
                    "--precision", precision)
    records = read_metrics(out)
    config = json.loads((out / "config.json").read_text())
    assert (config["strategy"], config["world_size"], config["precision"]) == ("ddp", 2, precision)
    assert records[-1]["train_samples"] == 1442 and records[-1]["val_accuracy"] > 0.9
    if precision == "fp16":
        assert records[-1]["skipped_steps"] < 10


def test_ddp_two_gpus_matches_one_gpu_in_fp32(tmp_path):
    common = ["--model", "mlp", "--precision", "fp32", "--optimizer", "sgd", "--seed", "1"]
    one, _ = _train(tmp_path, "one", *common, "--devices", "1", "--batch-size", "64")
    two, _ = _train(tmp_path, "two", *common, "--devices", "2", "--batch-size", "32")
    a = torch.load(one / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(two / "checkpoints" / "last.pt", weights_only=True)["model"]
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-4)


class Recorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.devices = []

    def forward(self, x):
        self.devices.append(x.device.index)
        return self.fc(x)


def _isolated(check) -> None:
    """Run `check` in a fresh process: CUDA contexts left in pytest's own process would make
    these GPUs look busy to the launcher tests that follow."""
    import multiprocessing

    proc = multiprocessing.get_context("spawn").Process(target=check)
    proc.start()
    proc.join(timeout=180)
    assert proc.exitcode == 0, f"{check.__name__} failed in its process (see its traceback above)"


def test_dataparallel_wraps_after_moving_and_splits_over_both_gpus():
    _isolated(check_dataparallel_wrap)


def test_dataparallel_replicas_keep_their_threads_and_the_autocast_dtype():
    _isolated(check_replica_threads)


def test_prefetched_batches_arrive_intact_on_the_gpu():
    _isolated(check_prefetch)


def check_dataparallel_wrap():
    rt = multigpu.setup("dp", "fp32", devices=[0, 1])
    cpu_model = Recorder()  # weights on the CPU, as a user builds them (trap 1)
    model = rt.prepare(cpu_model)
    assert isinstance(model, nn.DataParallel)
    assert next(cpu_model.parameters()).device == torch.device("cuda", 0)
    out = model(torch.randn(8, 4, device="cuda:0"))
    assert out.shape == (8, 2) and out.device == torch.device("cuda", 0)
    assert sorted(cpu_model.devices) == [0, 1], "the batch must be split over both GPUs"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.module(torch.randn(8, 4, device="cuda:0"))
    assert any("outside DataParallel" in str(w.message) for w in caught)


class Probe(nn.Module):
    """Records, for every replica call, what the thread running it sees."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8, 2)
        self.seen = []

    def forward(self, x, fail=False):
        import threading

        if fail and x.device.index == 1:
            raise ValueError("replica failure")
        out = self.fc(self.conv(x).mean((2, 3)))
        self.seen.append((x.device.index, threading.current_thread().name, out.dtype,
                          torch.is_grad_enabled()))
        return out


def check_replica_threads():
    import threading

    from multigpu.core.strategies.replica_threads import worker_threads

    torch.backends.cudnn.benchmark = True  # stays on for dp now: the threads keep their cache
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # exact grads
    rt = multigpu.setup("dp", "bf16", devices=[0, 1])
    probe = Probe()
    reference = Probe().cuda(0)
    reference.load_state_dict(probe.state_dict())
    model = rt.prepare(probe)
    x = torch.randn(8, 3, 16, 16, device="cuda:0")
    for _ in range(3):
        with rt.autocast():
            out = model(x)
    # torch's own parallel_apply passes on "enabled" but not the dtype: float16 in the replicas.
    assert out.dtype == torch.bfloat16, out.dtype
    assert {s[2] for s in probe.seen} == {torch.bfloat16}
    names = {d: {s[1] for s in probe.seen if s[0] == d} for d in (0, 1)}
    assert all(len(n) == 1 for n in names.values()), f"one thread per GPU across steps: {names}"
    assert names[0] != names[1] and threading.current_thread().name not in names[0] | names[1]
    assert worker_threads() == {0: names[0].pop(), 1: names[1].pop()}
    with torch.no_grad():
        model(x)
    assert probe.seen[-1][3] is False and probe.seen[-3][3] is True
    # fp32 gradients through the persistent threads equal one GPU's on the whole batch
    model.zero_grad()
    model(x).square().sum().backward()
    reference(x).square().sum().backward()
    for (name, p), q in zip(probe.named_parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-4), name
    try:
        model(x, fail=True)
    except ValueError as exc:
        assert "replica 1, on cuda:1" in " ".join(getattr(exc, "__notes__", [])), exc
    else:
        raise AssertionError("a replica's exception must reach the caller")
    model(x)  # the threads survive a failed step


def check_prefetch():
    from torch.utils.data import DataLoader, TensorDataset

    rt = multigpu.setup("single", "fp32", devices=[1])
    x = torch.randn(1000, 3, 32, 32)
    loader = rt.prepare(DataLoader(TensorDataset(x, torch.arange(1000)), batch_size=64, shuffle=True))
    seen = []
    for xb, yb in loader:
        assert xb.device == torch.device("cuda", 1) and xb.is_contiguous()
        torch.cuda._sleep(1000)  # keep the compute stream busy while the next copy is in flight
        assert torch.equal(xb.cpu(), x[yb.cpu()])
        seen.append(yb.cpu())
    assert sorted(torch.cat(seen).tolist()) == list(range(1000))


def test_ddp_with_nccl_max_ctas_trains_as_the_default_in_a_group_of_its_own(tmp_path):
    script = Path(__file__).resolve().parents[1] / "multiproc" / "lib_scripts" / "max_ctas.py"
    proc = run_multigpu("run", "--devices", "2", "--log-dir", tmp_path, script)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["world_size"] == 2 and result["own_group"] is True and result["max_ctas"] == 2
    assert result["max_diff"] < 1e-5, "capping NCCL's SMs must not change the sums"


def test_bench_records_gpu_clocks_per_trial_and_runs_the_nccl_variants(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_multigpu("bench", "--model", "mlp", "--devices", "0,1", "--gpus", "1,2",
                        "--methods", "multigpu-single,multigpu-ddp,multigpu-ddp:ctas8",
                        "--batch-size", "256", "--steps", "20", "--warmup", "3", "--trials", "2",
                        "--out", out)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    rows = {(r["method"], r["gpus"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("multigpu-single", 1), ("multigpu-ddp", 2), ("multigpu-ddp:ctas8", 2)}
    for row in rows.values():
        assert len(row["trial_gpu"]) == 2, row
        for trial in row["trial_gpu"]:
            assert trial["sm_mhz"] > 100 and trial["samples"] >= 2 and trial["temp_c"] > 0, trial
