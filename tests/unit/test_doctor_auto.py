"""`multigpu doctor --auto`, its reading of a script: each change of `multigpu run --auto` at its
line, the refusals the source shows, and what is left to run time. Nothing here runs a script."""
import textwrap
from pathlib import Path

from multigpu.auto import CHANGES
from multigpu.doctor.auto_checks import FINDERS, auto_findings

REPO = Path(__file__).resolve().parents[2]
TUTORIAL = REPO / "tests/multiproc/scripts/auto_tutorial.py"
MNIST = REPO / "tests/gpu/scripts/auto_mnist_style.py"
CUDA = ("each process sees only its own GPU: .cuda(), 'cuda', 'cuda:0', torch.device('cuda') and "
        "a DataParallel of its own all land on it")
SPLIT = ("split over the processes, every sample once per epoch, a new order each epoch; "
         "batch_size is the global batch unless --auto-batch per-gpu")
WHOLE = "left whole on every process, so evaluation code and its metrics stay right"
EVAL = "evaluation: read whole on every process, as a loader without shuffle"
GRADS = ("the modules whose parameters it holds average their gradients over the processes "
         "during backward, as DDP does; rank 0's weights first; every trainable parameter must "
         "get a gradient each step unless --auto-unused")
SAVE = ("written once, by rank 0 (or into a file the script opened: each process pickles the "
        "script's own class), without module./_orig_mod. prefixes; the others wait until the "
        "file exists; such a file loads back into the script's DataParallel")
OUTPUT = "rank 0's on the console, the others' in their log files (the launcher)"
FILES = ("rank 0's, whole and once; the other processes write their own copies under the run's log "
         "folder and read those back; their folders made and removed the same way")
UNKNOWN = ("whether it shuffles is decided when it runs (the source does not show it): split over "
           "the processes if it shuffles then, whole on every process if not")
RUNTIME = ("ok    auto run       decided when the script runs, not by this reading: whether each "
           "line above runs, the shuffle of a DataLoader the source does not show, and every "
           "refusal (--auto refuses what the script does, when it does it); ")


def lines(path, nproc=2, mode="global", ran=True):
    return [f.line() for f in auto_findings(path, nproc=nproc, mode=mode, ran=ran)]


def test_every_change_of_auto_has_its_place_in_a_source():
    assert set(FINDERS) == {what for what, _ in CHANGES}


def test_the_tutorial_script_each_change_at_its_line():
    t = TUTORIAL
    assert lines(t) == [
        f"ok    auto devices   {t}:46: 'cuda' (and line 51): --auto: {CUDA}",
        f"ok    auto data      {t}:47: DataLoader(Indexed(48, 1), batch_size=args.ba...: --auto: {SPLIT}",
        f"ok    auto data      {t}:48: DataLoader(Indexed(16, 2), batch_size=8): --auto: {WHOLE}",
        f"ok    auto gradients {t}:52: torch.optim.SGD(model.parameters(), lr=args.lr): --auto: {GRADS}",
        f"ok    auto eval      {t}:67: for x, y, idx in test_loader under torch.no_grad(): --auto: {EVAL}",
        f"ok    auto output    {t}:70: print(f'epoch {{epoch}}: test loss {{total / cou...: --auto: {OUTPUT}",
        f"ok    auto save      {t}:72: torch.save(model.state_dict(), 'model.pt'): --auto: {SAVE}",
        f"ok    auto files     {t}:79: open(f\"seen_rank{{os.environ.get('RANK', '0')}}...: --auto: {FILES}",
        RUNTIME + "the run below shows it for these arguments"]


def test_mnist_style_loaders_shuffled_through_kwargs_are_left_to_run_time():
    m = MNIST
    assert lines(m, ran=False) == [
        f"ok    auto eval      {m}:37: for data, target in loader under torch.no_grad(): --auto: {EVAL}",
        f"ok    auto output    {m}:41: print(f'Test set: Accuracy: {{correct}}/{{len(lo... "
        f"(and line 72): --auto: {OUTPUT}",
        f"ok    auto devices   {m}:50: 'cuda': --auto: {CUDA}",
        f"ok    auto data      {m}:56: DataLoader(classes(1024, 1), **train_kwargs): {UNKNOWN}",
        f"ok    auto data      {m}:57: DataLoader(classes(300, 2), **test_kwargs): {UNKNOWN}",
        f"ok    auto gradients {m}:59: torch.optim.Adadelta(model.parameters(), lr=1.0): --auto: {GRADS}",
        f"ok    auto save      {m}:70: torch.save(model.state_dict(), 'mnist_cnn.pt') (and line 71): --auto: {SAVE}",
        RUNTIME + "--no-step: not run; doctor --auto without it runs the script to its first step"]


def test_refusals_a_source_shows_are_warnings_worded_if_it_runs(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent("""\
        import torch
        import torch.distributed as dist
        from torch.utils.data import DataLoader, IterableDataset, WeightedRandomSampler

        class Stream(IterableDataset):
            def __iter__(self):
                yield 1

        def setup(distributed):
            if distributed:
                dist.init_process_group("nccl")

        ds = list(range(30))
        a = DataLoader(ds, batch_size=10, shuffle=True)
        b = DataLoader(ds, batch_sampler=[[0, 1]])
        c = WeightedRandomSampler([1.0] * 30, 30)
        """))
    found = auto_findings(path, nproc=3, mode="global", ran=True)
    warns = [f.line() for f in found if f.level == "warn"]
    assert found[0].line().startswith(f"ok    auto data      {path}:5: class Stream(IterableDataset)"
                                      ": --auto: split when a pass over it trains"), "not refused"
    assert warns == [
        f"warn  auto refuses   {path}:11: dist.init_process_group('nccl'): if it runs, --auto "
        "refuses it there: the script is distributed already; run it with `multigpu run` without "
        "--auto",
        f"warn  auto refuses   {path}:14: batch_size=10 is refused when this DataLoader is built: "
        "--auto splits it as the global batch over 3 processes; give a multiple of 3, or "
        "--auto-batch per-gpu",
        f"warn  auto refuses   {path}:15: a DataLoader with a batch_sampler of the script's own is "
        "refused when it is built: --auto makes the batches itself; give it batch_size and "
        "shuffle=True, or run without --auto",
        f"warn  auto refuses   {path}:16: WeightedRandomSampler([1.0] * 30, 30) draws with "
        "replacement: a shuffled DataLoader given it is refused when it is built (an exact split "
        "has no meaning for it); use shuffle=True, or run without --auto"]
    per_gpu = auto_findings(path, nproc=3, mode="per-gpu", ran=True)
    assert not any("global batch" in f.message for f in per_gpu if f.check == "auto refuses")


UNSPLIT = ("left as it is: nothing averaged (no optimizer) or split (no shuffled DataLoader), so "
           "each process trains on all of it alone and rank 0's result is kept; rank 0 says so "
           "in one note when training starts, with what would split it")


def test_training_that_auto_leaves_whole_is_a_warning_at_its_backward():
    """A hand-written update (no optimizer named), batches sliced from a tensor (no loader
    named): --auto splits and averages nothing there, and the reading said nothing of it."""
    scripts = REPO / "tests/multiproc/scripts"
    manual, sliced = scripts / "auto_notes_manual_sgd.py", scripts / "auto_notes_sliced.py"
    assert [f for f in lines(manual) if "auto unsplit" in f] == [
        f"warn  auto unsplit   {manual}:22: torch.autograd.grad(loss, list(model.paramete... (and "
        f"line 25): --auto: {UNSPLIT}"]
    assert [f for f in lines(sliced) if "auto unsplit" in f] == [
        f"warn  auto unsplit   {sliced}:22: loss.backward(): --auto: {UNSPLIT}"]
    assert not [f for f in lines(TUTORIAL) + lines(MNIST) if "auto unsplit" in f]


def test_random_draws_of_a_script_that_seeds_nothing_are_said_and_a_seed_silences_them(tmp_path):
    script = tmp_path / "toy.py"
    body = ("import torch\nx = torch.randn(64, 3)\nmodel = torch.nn.Linear(3, 1)\n"
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n")
    script.write_text(body)
    seeds = [line for line in lines(script, ran=False) if "auto seeds" in line]
    assert seeds == [f"ok    auto seeds     {script}:2: torch.randn(64, 3): --auto: the same on "
                     "every process: each starts from rank 0's seeds (torch, random, numpy), so "
                     "data the script makes itself is the same everywhere, as in one process; "
                     "the script's own seed still wins. Once training begins on a split "
                     "DataLoader, each process draws its own numbers (noise, dropout) for its "
                     "part of the batch, as one process draws one for each sample; torch, numpy "
                     "and random each from a stream of its own"]
    script.write_text("import torch\ntorch.manual_seed(0)\n" + body)
    assert not [line for line in lines(script, ran=False) if "auto seeds" in line]


def test_batchnorm_layers_are_said_with_their_statistics_over_the_global_batch(tmp_path):
    script = tmp_path / "bn.py"
    script.write_text("import torch\nfrom torch import nn\nnet = nn.Sequential(nn.Linear(3, 4),\n"
                      "    nn.BatchNorm1d(4), torch.nn.LazyBatchNorm2d())\nnorm = nn.LayerNorm(4)\n")
    found = [line for line in lines(script, ran=False) if "auto batchnorm" in line]
    assert found == [f"ok    auto batchnorm {script}:4: nn.BatchNorm1d(4): --auto: its "
                     "batch statistics are over every process's share of the global batch, as "
                     "one process's over the whole batch, with the same running statistics on "
                     "every process: one small all-reduce per BatchNorm call in forward and one "
                     "in backward; the modules stay the script's own; with --auto-batch per-gpu "
                     "each process's own batch"]
