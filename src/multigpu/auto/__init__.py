"""Zero-edit data parallelism: `multigpu run --auto script.py` runs an unmodified one-device
training script in every process the launcher starts, data-parallel.

Each process starts as `python -m multigpu.auto.worker MODE script.py ARGS` (worker.py). Before
the script runs, the worker narrows the GPUs the process sees to its own (devices.py), forms the
process group (NCCL on GPUs, gloo on CPU) and installs the patches below; then the script runs as
`python script.py ARGS` would run it. Each patch is its own module; CHANGES lists them all, in the
words a user reads (the worker's start line, and later `multigpu doctor --auto`).

A layer of its own above the launcher: it reuses the launcher's worker, and the launcher starts
it by module name only, never importing it.
"""
from __future__ import annotations

# (what the script does, what --auto makes of it): one place that says everything --auto changes
CHANGES = (
    ("CUDA", "each process sees only its own GPU: .cuda(), 'cuda', 'cuda:0', torch.device('cuda') "
             "and a DataParallel of its own all land on it (devices.py)"),
    ("DataLoader(shuffle=True)", "split over the processes, every sample once per epoch, a new "
                                 "order each epoch; batch_size is the global batch unless "
                                 "--auto-batch per-gpu (loaders.py)"),
    ("DataLoader without shuffle", "left whole on every process, so evaluation code and its "
                                   "metrics stay right (loaders.py)"),
    ("DataLoader over an IterableDataset (a stream)", "split when a pass over it trains "
                                                       "(gradients enabled), with or without "
                                                       "__len__: each process keeps its positions "
                                                       "of the stream, every item once per epoch; "
                                                       "a stream that shards itself by rank is "
                                                       "not split again, the processes ending "
                                                       "together; read whole under no_grad "
                                                       "(streams.py)"),
    ("a shuffled DataLoader read under torch.no_grad()", "evaluation: read whole on every "
                                                         "process, as a loader without shuffle "
                                                         "(loaders.py)"),
    ("optimizer", "the modules whose parameters it holds average their gradients over the "
                  "processes during backward, as DDP does; rank 0's weights first; every "
                  "trainable parameter must get a gradient each step unless --auto-unused "
                  "(gradients.py)"),
    ("BatchNorm (nn.BatchNorm1d, 2d, 3d)",
     "its batch statistics are over every process's share of the global batch, as one "
     "process's over the whole batch, with the same running statistics on every process: one "
     "small all-reduce per BatchNorm call in forward and one in backward; the modules stay the "
     "script's own; with --auto-batch per-gpu each process's own batch (batchnorm.py)"),
    ("torch.jit.trace, tensorboard's add_graph, torch.export.export",
     "the model is traced as the script's plain model (its class, its weights at that moment, "
     "without DDP's hooks), as on one device; its gradients are averaged as before (tracing.py)"),
    ("a forward called directly (model.forward(x))",
     "where the module's forward never runs as a call of the module (forward-forward's "
     "layers), its optimizer averages its gradients at each step instead: one all-reduce after "
     "backward, slower than DDP's (step_averaging.py)"),
    ("a torch loss with reduction='sum'",
     "multiplied by the number of processes while training on a split loader, so that its "
     "gradient is one process's on the global batch; a sum written by hand is said at the "
     "first backward, with its fix (summed_loss.py)"),
    ("training without a torch.optim optimizer, or on batches from no DataLoader",
     "left as it is: nothing averaged (no optimizer) or split (no shuffled DataLoader), so each "
     "process trains on all of it alone and rank 0's result is kept; rank 0 says so in one note "
     "when training starts, with what would split it (notes.py)"),
    ("random numbers the script draws without a seed",
     "the same on every process: each starts from rank 0's seeds (torch, random, numpy), so "
     "data the script makes itself is the same everywhere, as in one process; the script's own "
     "seed still wins. Once training begins on a split DataLoader, each process draws its own "
     "numbers (noise, dropout) for its part of the batch, as one process draws one for each "
     "sample; torch, numpy and random each from a stream of its own (seeds.py)"),
    ("torch.save(obj, path)", "written once, by rank 0 (or into a file the script opened: each "
                              "process pickles the script's own class), without module./_orig_mod. "
                              "prefixes; the others wait until the file exists; such a file loads "
                              "back into the script's DataParallel (saving.py)"),
    ("files the script writes (open(path, 'w'), savefig, np.save, save_image, shutil)",
     "rank 0's, whole and once; the other processes write their own copies under the run's log "
     "folder and read those back; their folders made and removed the same way (files.py)"),
    ("print, tqdm", "rank 0's on the console, the others' in their log files (the launcher)"),
    ("torch.distributed.init_process_group", "refused: the script is distributed already; run it "
                                             "with `multigpu run` without --auto (refusals.py)"),
)

BATCH_MODES = ("global", "per-gpu")
# `multigpu run --auto-unused`, to every process: DDP looks for parameters unused in each step
FIND_UNUSED_ENV = "MULTIGPU_AUTO_FIND_UNUSED"
