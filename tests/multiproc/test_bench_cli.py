"""`multigpu bench` end to end on CPU: real launches through our launcher, gloo, tiny settings."""
import json

import pytest

from .conftest import multigpu

pytestmark = pytest.mark.slow

TINY = ["--steps", "3", "--warmup", "1", "--trials", "2", "--image-size", "8"]
# Every method, and two DDP variants: static runs on gloo, bf16hook needs NCCL and is skipped.
ALL = ("multigpu-single,multigpu-dp,multigpu-ddp,multigpu-ddp:static,multigpu-ddp:bf16hook,ddp,"
       "accelerate,fabric")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "x.json"
    proc = multigpu("bench", "--model", "mlp", "--devices", "cpu:2", "--gpus", "1,2", *TINY,
                    "--batch-size", "16", "--methods", ALL, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return out, json.loads(out.read_text()), proc


def test_every_method_available_on_cpu_has_a_row(smoke):
    _, data, _ = smoke
    got = {(r["method"], r["gpus"]) for r in data["rows"]}
    assert got == {("multigpu-single", 1), ("ddp", 1), ("multigpu-ddp", 2),
                   ("multigpu-ddp:static", 2), ("ddp", 2)}
    for r in data["rows"]:
        assert len(r["trial_seconds"]) == 2 and r["img_per_s"] > 0 and r["step_ms"] > 0
        assert r["global_batch"] == 16 * r["gpus"] and r["flops_per_step_per_gpu"] > 0
        assert r["img_per_s_min"] <= r["img_per_s"] <= r["img_per_s_max"]
    single = next(r for r in data["rows"] if r["method"] == "multigpu-single")
    assert single["scaling_efficiency"] == 1.0 and single["optimizer"].startswith("SGD")
    ddp2 = next(r for r in data["rows"] if (r["method"], r["gpus"]) == ("multigpu-ddp", 2))
    assert ddp2["wrapper"] == "DistributedDataParallel" and ddp2["strategy"].startswith("ddp (2")
    static = next(r for r in data["rows"] if r["method"] == "multigpu-ddp:static")
    assert (static["variant"], ddp2["variant"], single["variant"]) == ("static", None, None)
    assert static["wrapper"] == "DistributedDataParallel" and static["strategy"].startswith("ddp (2")
    # each row against the one-GPU row: img/s over (GPUs x its img/s), the static variant's too
    for r in data["rows"]:
        assert r["scaling_efficiency"] == pytest.approx(r["img_per_s"] / (r["gpus"] * single["img_per_s"])), r


def test_methods_at_the_same_batch_and_gpus_take_turns_trial_by_trial(smoke):
    _, data, proc = smoke
    assert {(r["method"], r["gpus"]): r["interleaved"] for r in data["rows"]} == {
        ("multigpu-single", 1): 2, ("ddp", 1): 2, ("multigpu-ddp", 2): 3,
        ("multigpu-ddp:static", 2): 3, ("ddp", 2): 3}, "the DDP variant takes turns with its peers"
    assert "trials interleaved" in proc.stdout, proc.stdout[-3000:]
    assert proc.stdout.count(" samples/s, ") == 5, ("one console line per task", proc.stdout[-3000:])


def test_skipped_peers_are_named_with_a_reason_and_the_plot_is_written(smoke):
    out, data, proc = smoke
    skipped = {s["method"]: s["reason"] for s in data["skipped"]}
    assert set(skipped) >= {"multigpu-dp", "accelerate", "fabric", "multigpu-ddp:bf16hook"}
    assert "gloo" in skipped["multigpu-ddp:bf16hook"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert data["machine"]["label"] == "2xCPU" and data["versions"]["torch"]
    assert len(data["launches"]) == 2, ("one launch per process count", data["launches"],
                                        data["notes"])
    assert "multigpu-ddp" in proc.stdout and "scaling" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.extended
def test_real_and_synthetic_data_are_measured_in_the_same_launches(tmp_path):
    out = tmp_path / "real.json"
    proc = multigpu("bench", "--model", "cnn", "--data", "synthetic,real",
                    "--methods", "multigpu-single,multigpu-ddp,ddp", "--devices", "cpu:2",
                    "--gpus", "1,2", "--batch-size", "4", *TINY, "--image-size", "16",
                    "--data-dir", tmp_path / "images", "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    data = json.loads(out.read_text())
    rows = {(r["method"], r["gpus"], r["data"]): r for r in data["rows"]}
    assert set(rows) == {("multigpu-single", 1, "synthetic"), ("ddp", 1, "synthetic"),
                         ("multigpu-single", 1, "real"), ("multigpu-ddp", 2, "synthetic"),
                         ("ddp", 2, "synthetic"), ("multigpu-ddp", 2, "real")}
    assert len(data["launches"]) == 2, ("one launch per process count", data["launches"],
                                        data["notes"])
    real, synthetic = rows[("multigpu-ddp", 2, "real")], rows[("multigpu-ddp", 2, "synthetic")]
    assert (real["global_batch"], real["num_outputs"], synthetic["num_outputs"]) == (8, 10, 1000)
    assert real["warmup"] > 1, "the warm-up also drains the loader's prefetch queue"
    assert real["of_synthetic"] == pytest.approx(real["img_per_s"] / synthetic["img_per_s"])
    assert synthetic["of_synthetic"] is None and not real["compile"]
    assert (synthetic["interleaved"], rows[("ddp", 2, "synthetic")]["interleaved"],
            real["interleaved"]) == (2, 2, 1), "real data: multigpu-ddp has no peer to take turns with"
    assert data["settings"]["data"] == ["synthetic", "real"]
    assert any(s["method"] == "ddp" and "--data real" in s["reason"] for s in data["skipped"])
    assert "of synth." in proc.stdout, proc.stdout[-3000:]
    assert "real data: timed in the input pipeline's steady state" in " ".join(proc.stdout.split())
    assert list((tmp_path / "images").glob("jpeg-*/train/class_00/*.jpg"))


@pytest.mark.smoke
def test_unknown_method_is_one_line_and_exit_2(tmp_path):
    proc = multigpu("bench", "--model", "mlp", "--methods", "ddp,horovod", "--devices", "cpu:1",
                    "--out", tmp_path / "x.json")
    assert proc.returncode == 2
    assert "unknown method 'horovod'" in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
