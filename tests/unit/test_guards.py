"""The runtime guards in one process: the first non-finite loss found on the device, the run of
fp16-skipped steps, the warnings for a loop that goes around the Runtime, the global-batch note."""
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import multigpu
from multigpu.core import console
from multigpu.train.settings.config import TrainConfig
from multigpu.core.distributed import DistEnv
from multigpu.core.guards import SKIPPED_RUN_STEPS, FirstNonFinite, Found, SkippedRun
from multigpu.train.checks.train_guards import TrainGuards, global_batch_note, nonfinite_fix, nonfinite_message
from multigpu.train.training import learning_rate

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _console_speaks(monkeypatch):
    monkeypatch.setattr(console, "_enabled", True)  # as on rank 0, whatever ran before


def observed(losses, device="cpu", capacity=2) -> FirstNonFinite:
    first = FirstNonFinite(torch.device(device), capacity)  # small: it grows past it
    for i, value in enumerate(losses):
        first.observe(torch.tensor(value, device=device), i)
    return first


# --- the first non-finite loss --------------------------------------------------------------------

def test_a_nan_at_a_known_batch_is_found_at_that_batch():
    assert observed([2.3, 2.1, 1.9, NAN, 1.8]).agree(DistEnv()) == Found(3, "nan")


def test_of_two_bad_losses_the_first_is_kept_with_its_kind():
    assert observed([2.3, INF, 1.0, NAN, NAN]).agree(DistEnv()) == Found(1, "inf")
    assert observed([2.3, 1.0, NAN, INF]).agree(DistEnv()) == Found(2, "nan")
    assert observed([-INF, NAN]).agree(DistEnv()) == Found(0, "-inf")


def test_all_finite_losses_find_nothing_even_huge_ones():
    assert observed([2.3, 1e38, 0.0, -5.0]).agree(DistEnv()) is None
    assert observed([]).agree(DistEnv()) is None


def test_non_finite_weights_count_as_bad_at_the_batch_given_unless_a_loss_was_earlier():
    assert observed([1.0, 1.0]).agree(DistEnv(), weights_finite=False, now=1) == Found(1, "weights")
    assert observed([1.0, NAN]).agree(DistEnv(), weights_finite=False, now=1) == Found(1, "nan")


def test_observing_never_reads_the_value_back():
    # Meta tensors have no data: any read (.item(), a branch on a value) would raise here, as a
    # host-device sync would wait for the GPU there.
    first = observed([1.0, NAN, 2.0, 3.0, 4.0], device="meta")
    assert first.losses.device.type == "meta"


def test_each_search_goes_on_from_the_last_and_keeps_what_it_found():
    first = observed([1.0, 2.0, 3.0])
    assert first.local() is None
    for i, value in enumerate([4.0, INF, NAN], start=3):
        first.observe(torch.tensor(value), i)
    assert first.local() == Found(4, "inf")
    first.observe(torch.tensor(NAN), 6)
    assert first.local() == Found(4, "inf")


class OtherRank:
    """A DistEnv stand-in for rank 0 of two: all_max meets the other rank's values."""

    def __init__(self, other: FirstNonFinite):
        self.other = other

    def all_max(self, values):
        found = self.other.local()
        code = -(found.index * 4 if found else 4 * 2**40)
        return [max(values[0], code)]


def test_the_ranks_agree_on_the_lowest_first_bad_batch():
    mine, theirs = observed([1.0] * 7 + [NAN]), observed([1.0] * 5 + [NAN, NAN])
    assert mine.agree(OtherRank(theirs)) == Found(5, "nan")
    assert theirs.agree(OtherRank(observed([1.0] * 9))) == Found(5, "nan")
    assert observed([1.0]).agree(OtherRank(observed([1.0]))) is None


# --- the message and the guard of `multigpu train` -------------------------------------------------

def test_the_message_names_the_step_the_checkpoint_and_the_fix(tmp_path):
    out = tmp_path / "run"
    rt = multigpu.setup("single", accelerator="cpu")
    model = rt.prepare(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    guards = TrainGuards(rt, opt, out, lr=0.5, clip_grad_norm=None)
    first = guards.new_epoch(2, 171, batches_left=172, batches_per_epoch=188)  # resumed at 16
    assert guards.check(5, model, None) is None  # all finite so far
    for i in range(8):
        first.observe(torch.tensor(NAN if i == 0 else 1.0), i + 5)  # the 6th batch of this call
    error = guards.check(13, model, out / "checkpoints" / "step-000000168.pt")
    assert str(error) == (
        f"the loss became nan at step 177 (epoch 2, batch 22 of 188); weights after it are not "
        f"saved: the last good checkpoint is {out}/checkpoints/step-000000168.pt. Lower --lr "
        f"(now 0.5), add --clip-grad-norm 1.0, or check the data for NaN; resume from it with "
        f"--resume {out}")
    assert isinstance(error, multigpu.UsageError)  # the CLI prints one line, no traceback


def test_non_finite_weights_stop_at_the_step_that_made_them(tmp_path):
    rt = multigpu.setup("single", accelerator="cpu")
    model = rt.prepare(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    guards = TrainGuards(rt, opt, tmp_path, lr=0.5, clip_grad_norm=2.0)
    guards.new_epoch(1, 0, batches_left=10, batches_per_epoch=10)
    with torch.no_grad():
        model.weight[0, 1] = INF
    error = guards.check(4, model, None)
    assert str(error) == (
        "the weights became NaN/inf (the loss was still finite) at step 4 (epoch 1, batch 4 of "
        "10); weights after it are not saved: no checkpoint was saved before it. Lower --lr (now "
        "0.5), lower --clip-grad-norm (now 2), or check the data for NaN")


def test_a_checkpoint_from_elsewhere_is_named_for_resume_and_a_scheduled_lr_too(tmp_path):
    text = nonfinite_message(Found(3, "inf"), step=40, where="epoch 3, batch 4 of 10",
                             last_good=tmp_path / "old.pt", out=tmp_path / "run",
                             fix=nonfinite_fix(0.05, None, lr_now=5.0))
    assert "the loss became inf at step 40" in text
    assert "Lower --lr (now 0.05, 5 at that step after --scheduler)" in text
    assert text.endswith(f"resume from it with --resume {tmp_path / 'old.pt'}")


def test_fp16_does_not_track_the_loss_and_warns_once_about_a_long_run_of_skipped_steps(
        tmp_path, capsys):
    rt = multigpu.setup("single", precision="fp16", accelerator="cpu")
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = rt.prepare(model, opt)
    guards = TrainGuards(rt, opt, tmp_path, lr=0.1, clip_grad_norm=None)
    assert guards.new_epoch(1, 0, 100, 100) is None  # the GradScaler skips those steps instead
    for step in range(1, 3 * SKIPPED_RUN_STEPS + 1):
        with rt.autocast():
            loss = model(torch.full((3, 4), NAN)).float().sum()  # NaN data: every step skipped
        rt.backward(loss)
        rt.step(opt)
        guards.stepped()
        if step % 10 == 0:
            assert guards.check(step, model, None) is None  # never stops
    err = capsys.readouterr().err
    assert err.count("warning:") == 1, err
    assert (f"the last {SKIPPED_RUN_STEPS} optimizer steps were all skipped by fp16 loss scaling "
            "(loss scale now ") in err
    assert "check the data for NaN, lower --lr (now 0.1)" in err


def test_the_skipped_run_rule():
    run = SkippedRun(skipped=3, threshold=20)
    for _ in range(10):
        run.stepped()
    assert not run.look(13)      # 10 of 10 skipped: a run of 10
    for _ in range(10):
        run.stepped()
    assert run.look(23)          # 20 in a row: said once
    for _ in range(30):
        run.stepped()
    assert not run.look(53)      # the same run goes on: not again
    assert run.length == 50
    assert not run.look(53)      # no step since: nothing learned
    for _ in range(10):
        run.stepped()
    assert not run.look(62)      # one of 10 was taken: the run is over
    assert run.length == 0
    for _ in range(19):
        run.stepped()
    assert not run.look(81)      # 19 in a row: not yet
    run.stepped()
    assert run.look(82)          # a new run of 20: said again


# --- going around the Runtime -----------------------------------------------------------------------

def tiny(accumulate=1, precision="fp32", n=8):
    rt = multigpu.setup("single", precision=precision, accelerator="cpu", accumulate=accumulate)
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = rt.prepare(model, opt, DataLoader(ds, batch_size=2, shuffle=True))
    return rt, model, opt, loader


def loss_of(rt, model, x, y):
    with rt.autocast():
        return nn.functional.mse_loss(model(x).float(), y)


def test_loss_backward_instead_of_rt_backward_warns_once_naming_it(capsys):
    rt, model, opt, loader = tiny()
    for _ in range(2):
        for x, y in loader:
            loss_of(rt, model, x, y).backward()
            rt.step(opt)
    err = capsys.readouterr().err
    assert err.count("warning:") == 1, err
    assert "loss.backward() was called directly, not rt.backward(loss)" in err
    assert "call rt.backward(loss) instead" in err


def test_optimizer_step_instead_of_rt_step_warns_once_naming_it(capsys):
    rt, model, opt, loader = tiny()
    for _ in range(2):
        for x, y in loader:
            rt.backward(loss_of(rt, model, x, y))
            opt.step()
            opt.zero_grad()
    err = capsys.readouterr().err
    assert err.count("warning:") == 1, err
    assert "optimizer.step() was called directly, not rt.step(optimizer)" in err
    assert "call rt.step(optimizer) instead" in err


@pytest.mark.parametrize("accumulate,precision,clip", [
    (1, "fp32", None), (1, "fp32", 1.0), (2, "fp32", None), (3, "fp32", 0.5),
    (1, "fp16", None), (2, "fp16", 1.0), (1, "bf16", None)])
def test_the_normal_path_warns_nothing(capsys, accumulate, precision, clip):
    rt, model, opt, loader = tiny(accumulate, precision, n=10)  # a short last window too
    steps = 0
    for _ in range(2):
        for x, y in loader:
            rt.backward(loss_of(rt, model, x, y))
            steps += rt.step(opt, clip_grad_norm=clip)
    assert steps == 2 * -(-5 // accumulate)
    assert capsys.readouterr().err == ""


def test_two_optimizers_stepped_from_one_backward_warn_nothing(capsys):
    rt = multigpu.setup("single", accelerator="cpu")
    a, b = nn.Linear(4, 4), nn.Linear(4, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    a, b, opt_a, opt_b = rt.prepare(a, b, opt_a, opt_b)
    for _ in range(3):
        rt.backward(b(a(torch.randn(2, 4))).square().mean())
        rt.step(opt_a)
        rt.step(opt_b)
    assert capsys.readouterr().err == ""


def test_only_rank_0_warns(capsys):
    from multigpu.core.guards import Bypass

    Bypass(is_main=False).warn_once("step", "x")
    assert capsys.readouterr().err == ""


# --- the global batch and --lr ------------------------------------------------------------------------

def test_learning_rate_takes_lr_as_given_whatever_the_devices():
    assert learning_rate(TrainConfig.from_flat(model="mlp", lr=0.05, devices="cpu:8", accumulate=4)) == 0.05
    assert learning_rate(TrainConfig.from_flat(model="mlp", optimizer="sgd")) == 0.05


def test_the_global_batch_note():
    assert global_batch_note(32, 2, 1, 0.05, lr_given=True) == (
        "global batch 64 (32 per device x 2 devices): --lr 0.05 is used as given, not scaled, so "
        "an epoch makes 2x fewer optimizer steps than at batch 32 on one device; if accuracy lags "
        "the one-device run, try --lr 0.1 (linear scaling: --lr x 2) or more --epochs")
    note = global_batch_note(16, 1, 4, 1e-3, lr_given=False)
    assert note.startswith("global batch 64 (16 per device x 1 device x --accumulate 4): "
                           "--lr 0.001 (the default) is used as given")
    assert "try --lr 0.004 (linear scaling: --lr x 4)" in note
    assert global_batch_note(64, 1, 1, 0.05, lr_given=True) is None
    # an lr past any that trains is not advised higher still
    assert global_batch_note(32, 2, 1, 1e12, lr_given=True) == (
        "global batch 64 (32 per device x 2 devices): --lr 1e+12 is used as given, not scaled, so "
        "an epoch makes 2x fewer optimizer steps than at batch 32 on one device; --lr 1e+12 is far "
        "above the learning rates that train (below 10 for sgd, adam and adamw): check it for a typo")



def test_an_input_bound_epoch_is_one_that_waited_a_large_share_and_at_least_a_second():
    from multigpu.train.checks.train_guards import input_bound

    assert input_bound(0.41, 10.0) and input_bound(0.3, 3.4)
    assert not input_bound(0.29, 100.0)  # a share the step can live with
    assert not input_bound(0.89, 0.1)    # a job of seconds: nothing worth a warning


def test_an_input_bound_epoch_is_named_with_fixes_that_fit_its_data():
    from multigpu.train.checks.train_guards import input_bound_note

    assert input_bound_note(2, 0.41, 14, cores=16, one_gather=False, gpu_decode_left=True) == (
        "epoch 2 waited 41% of its time for the next batch: the input, not the training step, sets "
        "the pace; try --decode gpu (JPEGs decoded on the GPUs) or more --workers than 14 per "
        "process (16 cores each)")
    assert input_bound_note(3, 0.5, 1, cores=2, one_gather=False, gpu_decode_left=False).endswith(
        "try files that cost less to read and decode (smaller images), or more CPU cores: the "
        "training process and its 1 loader workers use the 2 cores of each process already")
    assert input_bound_note(3, 0.5, 0, cores=2, one_gather=True, gpu_decode_left=False).endswith(
        "try a larger --batch-size (each batch is one gather in the training process)")
