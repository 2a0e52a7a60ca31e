"""The shared training step's input handling."""
import re

import torch

from multigpu.train.data.data_bundle import IMAGENET_MEAN, IMAGENET_STD
from multigpu.train.engine import StepSettings, prepare_inputs


def test_uint8_images_are_normalised_on_the_device_like_the_float_pipeline():
    x = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    settings = StepSettings.for_data((IMAGENET_MEAN, IMAGENET_STD), torch.device("cpu"),
                                     channels_last=True)
    out = prepare_inputs(x, settings)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(out, (x.float() / 255 - mean) / std)
    assert out.dtype == torch.float32 and out.is_contiguous(memory_format=torch.channels_last)


def test_float_inputs_pass_through_untouched():
    x = torch.randn(2, 3, 4, 4)
    assert prepare_inputs(x, StepSettings()) is x


def test_out_of_memory_message_names_the_cause_and_three_fixes(monkeypatch):
    from types import SimpleNamespace

    from multigpu.train.settings.config import TrainConfig
    from multigpu.train.training import oom_message as _oom_message

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(total_memory=80 * gib))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 61.5 * gib)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 64 * gib)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(0.5 * gib), 80 * gib))
    rt = SimpleNamespace(device=torch.device("cuda", 1), precision=SimpleNamespace(kind="fp32"))
    message = _oom_message(TrainConfig.from_flat(model="resnet50", batch_size=256), rt)
    assert message.startswith("CUDA out of memory on cuda:1 (80 GiB: this run's peak 61.5 GiB, "
                              "other processes 15.5 GiB) with --batch-size 256 per GPU")
    assert "--batch-size auto" in message
    assert "--batch-size 128" in message and "--accumulate 2" in message
    assert "--precision bf16" in message and "\n" not in message


class Logged(torch.nn.Module):
    """A linear layer that logs its forwards; with `compiled`, it looks like torch.compile's
    OptimizedModule (an `_orig_mod` attribute), on CPU."""

    def __init__(self, log: list, compiled: bool):
        super().__init__()
        self.fc, self.log = torch.nn.Linear(3, 2), log
        if compiled:
            self._orig_mod = self.fc

    def forward(self, x):
        self.log.append("forward")
        return self.fc(x)


class Wrapper(torch.nn.Module):  # holds its model as `.module`, as DDP and DataParallel do
    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, x):
        return self.module(x)


def test_every_step_of_a_compiled_model_marks_a_new_cuda_graph_step_before_its_forward(monkeypatch):
    import multigpu
    from multigpu.train.engine import evaluate, train_step

    log = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: log.append("mark"))
    rt = multigpu.setup("single", accelerator="cpu")
    batch = (torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
    for model, compiled in ((Logged(log, False), False), (Logged(log, True), True),
                            (Wrapper(Logged(log, True)), True)):
        log.clear()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            train_step(rt, model, opt, torch.nn.functional.cross_entropy, batch, StepSettings())
        evaluate(rt, model, torch.nn.functional.cross_entropy, [batch], True, StepSettings())
        step = ["mark", "forward"] if compiled else ["forward"]
        assert log == step * 3, "two steps and one eval batch, marked before each forward"


def test_compile_modes_that_record_cuda_graphs_are_refused_where_they_cannot_run():
    import pytest

    from multigpu.core import compiling
    from multigpu.core.errors import UsageError
    from multigpu.train.settings.flagwords import say

    def refused(*args, **kwargs) -> UsageError:
        with pytest.raises(UsageError) as caught:
            compiling.check(*args, **kwargs)
        return caught.value

    for mode in (None, "default", "max-autotune-no-cudagraphs"):
        compiling.check(mode, "cpu", "single")  # no CUDA graphs: fine anywhere
    compiling.check("reduce-overhead", "cuda", "ddp")
    # the command line's words (multigpu train says the library's message with its flags)
    assert say(refused("reduce-overhead", "cpu", "ddp")).endswith("need GPUs; on cpu use --compile default")
    assert re.search("one process per GPU.*use --strategy ddp", say(refused("max-autotune", "cuda", "dp")))
    assert say(refused("fast", "cuda", "ddp")).startswith("--compile fast: choose from default, reduce-overhead")
    assert ("overwrites the gradients that --accumulate 4 adds up; use --accumulate 1 with a larger "
            "--batch-size, or --compile default") in say(refused("reduce-overhead", "cuda", "ddp", accumulate=4))
    assert say(refused("max-autotune", "cpu", "single")).endswith(
        "on cpu use --compile max-autotune-no-cudagraphs")
    # the library's own words: its arguments, never a flag
    assert str(refused("reduce-overhead", "cuda", "ddp", accumulate=4)) == (
        "compile_model(mode='reduce-overhead') records CUDA graphs, whose next replay overwrites the "
        "gradients that setup(accumulate=4) adds up; use setup(accumulate=1) with a larger "
        "batch_size, or compile_model(mode='default')")
    assert str(refused("fast", "cuda", "ddp")).startswith("compile_model(mode='fast'): choose from")
    with pytest.raises(UsageError, match=r"use setup\(strategy='ddp'\), or compile_model\("
                                         r"mode='default'\)$"):  # the library's own call
        compiling.compile_model(torch.nn.DataParallel(torch.nn.Linear(2, 2)), "reduce-overhead")
    model = torch.nn.Linear(2, 2)
    assert compiling.compile_model(model, None) is model and not compiling.is_compiled(model)
    model.compile()  # nn.Module.compile(): compiled in place, at its first call
    assert compiling.is_compiled(model) and compiling.is_compiled(Wrapper(model))


def test_compile_auto_uses_cuda_graphs_only_where_they_work_and_pay():
    from multigpu.train import training
    from multigpu.core import compiling

    long_run = training.AUTO_MIN_STEPS
    assert training.auto_mode("cuda", "ddp", 1, long_run) == (
        "reduce-overhead", f"--compile auto: CUDA graphs (reduce-overhead) for {long_run:,} steps; the "
        "first steps compile, the compile cache is kept for the next run")
    mode, why = training.auto_mode("cuda", "ddp", 1, long_run - 1)
    assert mode is None and why == (
        f"--compile auto: not compiled: {long_run - 1:,} steps are too few to win back compiling "
        f"(about 46 s; from {long_run:,} steps CUDA graphs are used)")
    assert training.auto_mode("cpu", "ddp", 1, 10**6) == (
        None, "--compile auto: not compiled (CUDA graphs need GPUs)")
    assert training.auto_mode("cuda", "dp", 1, 10**6)[0] is None
    assert training.auto_mode("cuda", "ddp", 2, 10**6) == (
        None, "--compile auto: not compiled (CUDA graphs cannot work with --accumulate 2)")
    compiling.check("auto", "cpu", "dp", accumulate=4)  # decided per run, never refused up front


def test_the_compile_cache_goes_to_a_per_user_folder_unless_one_is_set(tmp_path):
    from multigpu.core import compiling

    env = {"XDG_CACHE_HOME": str(tmp_path)}
    compiling.use_persistent_cache(env)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "multigpu" / "torch-compile")
    mine = {"TORCHINDUCTOR_CACHE_DIR": "/data/cache", "XDG_CACHE_HOME": str(tmp_path)}
    compiling.use_persistent_cache(mine)
    assert mine["TORCHINDUCTOR_CACHE_DIR"] == "/data/cache"


class _SlowDataset(torch.utils.data.Dataset):
    """24 samples, each read `delay` seconds after it is asked for (input that cannot keep up)."""

    def __init__(self, delay: float):
        self.delay = delay
        self.x, self.y = torch.randn(24, 3), torch.randn(24, 1)

    def __len__(self):
        return 24

    def __getitem__(self, i):
        import time

        time.sleep(self.delay)
        return self.x[i], self.y[i]


class _SlowStep(torch.nn.Module):
    """A linear layer whose forward takes `delay` seconds more (a step the input keeps up with)."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay, self.linear = delay, torch.nn.Linear(3, 1)

    def forward(self, x):
        import time

        time.sleep(self.delay)
        return self.linear(x)


def test_an_epoch_says_which_share_of_its_time_went_to_waiting_for_batches():
    import multigpu
    from multigpu.train.engine import StepParts, train_epoch

    rt = multigpu.setup("single", "fp32", accelerator="cpu")
    shares = {}
    for slow_input, slow_step in ((0.0125, 0.0), (0.0, 0.05)):  # 0.05 s a batch of 4, either side
        loader = torch.utils.data.DataLoader(_SlowDataset(slow_input), batch_size=4)
        model, loader = rt.prepare(_SlowStep(slow_step), loader)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        parts = StepParts(model, optimizer, torch.nn.functional.mse_loss, StepSettings())
        record = train_epoch(rt, parts, loader)
        assert record["train_samples"] == 24
        shares["input" if slow_input else "step"] = record["input_wait"]
        if slow_input:  # 0.3 s of sleeping in the loader, all of it counted
            assert record["input_wait"] * record["epoch_seconds"] >= 0.3 * 0.99
    assert shares["input"] > 0.7 and shares["step"] < 0.3, shares


def test_compile_model_leaves_the_compile_cache_to_its_caller(tmp_path):
    # a library call changes no environment variable of multigpu's: the cache folder is set by
    # `multigpu train` and bench (use_persistent_cache, above), or by the user
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    code = ("import os, torch, multigpu; multigpu.compile_model(torch.nn.Linear(2, 2), 'default'); "
            "print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert str(tmp_path) not in out.stdout, out.stdout
