"""What to measure: the settings of one `multigpu bench` invocation, and the launches they need.

Every (method, model, batch size, GPU count) is one Task. Tasks are grouped so that as few
processes as possible are started, because each start costs seconds of GPU time (imports, CUDA
context, NCCL setup) while a measurement costs a few seconds:
  1. one process on one GPU: multigpu-single (the reference) and the peers on 1 GPU;
  2. for each GPU count N >= 2, largest first: N processes that run multigpu-ddp, its variants
     (multigpu-ddp:static, ...: one DDP knob changed), the hand-written DDP, Accelerate and Fabric
     in the same processes and the same process group (Accelerate's PartialState and Fabric's
     _init_dist_connection both reuse an initialised default group instead of creating one);
  3. last, one process that drives N GPUs with DataParallel for each N (slow on some machines, so
     it has its own, smaller, --dp-steps and goes last: a time limit cuts it first).
The order is also the order of importance, so a run stopped early keeps what matters most.
Inside a group, consecutive tasks that differ only in the method (same model, batch, image size,
data, GPU count and compile) run together: all are built, then their trials take turns (see
worker.py), so a drift of the machine over minutes does not favour the method timed last. That is
why a DDP knob is a method of its own: between two invocations the machine drifted by up to 27 %,
more than any knob changes.
With several data kinds (--data synthetic,real) every group runs its synthetic tasks first, then
the real-data ones, in the same processes: real as a share of synthetic is then measured within
one run on one machine, without paying for more launches.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field, replace

from multigpu.core import compiling
from multigpu.core.errors import UsageError
from multigpu.core.system.extras import install_hint
from multigpu.core.strategies import STRATEGIES

OURS_PREFIX = "multigpu-"  # multigpu-<strategy>: `multigpu train`'s step under that strategy
OURS = tuple(OURS_PREFIX + name for name in STRATEGIES)  # the methods --compile applies to
PEERS = ("ddp", "accelerate", "fabric")
METHODS = (*OURS, *PEERS)
# All but fsdp, which is for models larger than a GPU: ask for it with --methods
DEFAULT_METHODS = tuple(m for m in METHODS if m != "multigpu-fsdp")
DATA_KINDS = ("synthetic", "real", "real-cpu", "real-gpu")
# Real-data kinds: the same JPEG folder through `multigpu train`'s pipeline, with its --decode.
REAL_DECODE = {"real": "auto", "real-cpu": "cpu", "real-gpu": "gpu"}
NUM_CLASSES = 1000  # synthetic data: ImageNet-sized classifier head, as in BASELINE.md
DDP = "multigpu-ddp"


@dataclass(frozen=True)
class DDPVariant:
    """multigpu-ddp with one knob changed, run as the method `multigpu-ddp:<name>`: a method of its
    own, so that its trials take turns with multigpu-ddp's in the same launch."""
    about: str  # one line, for --methods' help
    options: dict = field(default_factory=dict)  # DDPOptions fields that differ from ours
    bf16_hook: bool = False  # + torch's bf16_compress_hook on the DDP wrapper (needs NCCL)

    @property
    def needs_nccl(self) -> bool:
        """Skipped on CPU: gloo has neither the bf16 hook nor NCCL's communicator settings."""
        return self.bf16_hook or self.options.get("nccl_max_ctas") is not None

    def apply(self, options):
        """`options` (DDPOptions) with this variant's changes."""
        return replace(options, **self.options)

    def add_comm_hook(self, model) -> None:
        """bf16hook: torch's bf16_compress_hook on a DDP wrapper, before its first backward. Any
        other module (one process, DataParallel) all-reduces nothing: nothing to register."""
        from torch.nn.parallel import DistributedDataParallel

        if self.bf16_hook and isinstance(model, DistributedDataParallel):
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.bf16_compress_hook)


DDP_VARIANTS = {
    "bucket25": DDPVariant("25 MB buckets, torch's default; ours are 100 MB",
                           {"bucket_cap_mb": 25}),
    "bucket200": DDPVariant("200 MB buckets, ResNet-50's gradients in one",
                            {"bucket_cap_mb": 200}),
    "static": DDPVariant("static_graph=True, DDP is told the graph never changes",
                         {"static_graph": True}),
    "bcast": DDPVariant("broadcast_buffers=True, torch's default: rank 0's buffers copied to every "
                        "rank before every forward", {"broadcast_buffers": True}),
    "bf16hook": DDPVariant("gradients all-reduced in bf16 by torch's bf16_compress_hook; GPUs only",
                           bf16_hook=True),
    "ctas8": DDPVariant("NCCL may take at most 8 SMs from the backward (maxCTAs); GPUs only",
                        {"nccl_max_ctas": 8}),
    "bucket25-ctas8": DDPVariant("25 MB buckets, overlapped with the backward, on at most 8 SMs; "
                                 "GPUs only", {"bucket_cap_mb": 25, "nccl_max_ctas": 8}),
}


@dataclass
class BenchSettings:
    models: tuple[str, ...] = ("resnet50",)
    batch_sizes: tuple[int, ...] = (128,)  # per GPU (per process on CPU)
    precision: str = "auto"
    gpus: tuple[int, ...] | None = None  # GPU counts to measure; None = 1, 2, 4, ... up to all
    methods: tuple[str, ...] = DEFAULT_METHODS
    data: tuple[str, ...] = ("synthetic",)  # in the order of DATA_KINDS
    compile: str | None = None  # torch.compile mode for the multigpu methods' model, as
    # `multigpu train --compile MODE` (None: not compiled)
    steps: int = 30
    warmup: int = 10
    trials: int = 3
    dp_steps: int | None = None  # steps per DataParallel trial (default: steps)
    image_size: int | None = None  # default: the model's own (224 for resnet50)
    devices: str = "auto"
    min_free_memory: float = 2.0
    out: str | None = None
    data_dir: str | None = None  # cache of the generated JPEG folder (--data real)
    images: str = "smooth"  # which generated folder --data real reads (bench.imagegen.KINDS)
    folder: str | None = None  # --data folder:PATH: the real kinds read it instead
    command: str = ""  # the command line, recorded in the JSON


@dataclass
class Task:
    """One measurement. JSON-serialisable: the parent writes it into the worker's job file."""
    method: str
    model: str
    batch_size: int
    gpus: int  # GPUs the run uses (CPU processes on CPU)
    image_size: int
    precision: str  # as asked ("auto" is resolved in the worker, per device)
    data: str  # "synthetic" or "folder:PATH"
    num_outputs: int
    warmup: int
    steps: int
    trials: int
    compile: str | None = None  # torch.compile mode of the prepared model (multigpu methods only)
    decode: str = "auto"  # real data: `multigpu train --decode`

    @property
    def data_kind(self) -> str:
        if not self.data.startswith("folder:"):
            return "synthetic"
        return next(kind for kind, decode in REAL_DECODE.items() if decode == self.decode)

    @property
    def variant(self) -> str | None:
        return ddp_variant(self.method)

    @property
    def key(self) -> str:
        # The data kind too: one run can measure the same method/model/batch/GPUs on both kinds.
        return f"{self.method}|{self.model}|b{self.batch_size}|x{self.gpus}|{self.data_kind}"

    def describe(self) -> str:
        """'multigpu-ddp x2 mlp batch 16', with ', real data' when that is what it reads."""
        return f"{self.method} x{self.gpus} {self.model} batch {self.batch_size}{data_note(self.data_kind)}"


def data_note(kind: str | None) -> str:
    """', real data' (', real data, CPU decode') after a task or a row of that kind; '' for synthetic."""
    return {"real": ", real data", "real-cpu": ", real data, CPU decode",
            "real-gpu": ", real data, GPU decode"}.get(kind or "", "")


@dataclass
class Group:
    """Tasks that run one after another in the same freshly launched processes."""
    nproc: int
    visible: int  # GPUs made visible to the group (0 on CPU)
    tasks: list[Task] = field(default_factory=list)

    def describe(self) -> str:
        where = f"{self.visible} GPU{'s' if self.visible != 1 else ''}" if self.visible else "CPU"
        methods = ", ".join(dict.fromkeys(t.method for t in self.tasks))
        return f"{self.nproc} process{'es' if self.nproc != 1 else ''} on {where}: {methods}"


# --------------------------------------------------------------------------- parsing flags

def parse_int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in str(text).replace(" ", "").split(",") if v)
    except ValueError:
        values = ()
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{flag} {text!r} is not a list of positive integers; write e.g. {flag} 1,2,4")
    return tuple(dict.fromkeys(values))  # keep the order, drop repeats


def parse_methods(text: str) -> tuple[str, ...]:
    methods = tuple(dict.fromkeys(m.strip() for m in str(text).split(",") if m.strip()))
    unknown = [m for m in methods if m not in METHODS and base_method(m) != DDP]
    if unknown or not methods:
        named = ", ".join(map(repr, unknown)) or "(none)"
        raise UsageError(f"--methods {text}: unknown method {named}; choose from {','.join(METHODS)}"
                         f" or {DDP}:VARIANT")
    bad = [m for m in methods if base_method(m) == DDP and m != DDP
           and ddp_variant(m) not in DDP_VARIANTS]
    if bad:
        raise UsageError(f"--methods {text}: unknown DDP variant {bad[0]!r}; choose from "
                         f"{','.join(f'{DDP}:{v}' for v in DDP_VARIANTS)}")
    return methods


def base_method(method: str) -> str:
    """'multigpu-ddp' for 'multigpu-ddp:static': what a variant runs, is planned and plotted as."""
    return method.partition(":")[0]


def ddp_variant(method: str) -> str | None:
    """'static' for 'multigpu-ddp:static'; None for every other method, multigpu-ddp included."""
    base, colon, variant = method.partition(":")
    return variant if colon and base == DDP else None


def variant_of(method: str) -> DDPVariant | None:
    """The DDP_VARIANTS entry of a multigpu-ddp:<variant> method; None for every other method."""
    return DDP_VARIANTS.get(ddp_variant(method) or "")


def parse_data(text: str) -> tuple[str, ...]:
    """The data kinds, in the order of DATA_KINDS: each group runs synthetic before real.
    `folder:PATH` is the real kind, on that folder (parse_folder) instead of generated images."""
    named = [k.strip() for k in str(text).split(",") if k.strip()]
    if "real" in named and any(k.startswith("folder:") for k in named):
        raise UsageError(f"--data {text}: folder:PATH is the real kind on your folder, in place of "
                         "the generated images; give one of real and folder:PATH")
    kinds = {"real" if k.startswith("folder:") else k for k in named}
    unknown = sorted(kinds - set(DATA_KINDS))
    if unknown or not kinds:
        named = ", ".join(map(repr, unknown)) or "(none)"
        raise UsageError(f"--data {text}: unknown kind {named}; choose from {','.join(DATA_KINDS)} "
                         "or folder:PATH (or several: --data synthetic,real)")
    return tuple(k for k in DATA_KINDS if k in kinds)


def parse_folder(text: str) -> str | None:
    """The PATH of a `folder:PATH` item of --data (one at most), else None."""
    folders = [k.strip().removeprefix("folder:") for k in str(text).split(",") if k.strip().startswith("folder:")]
    if len(folders) > 1 or (folders and not folders[0]):
        raise UsageError(f"--data {text}: name one folder, as folder:PATH (its train/ is read)")
    return folders[0] if folders else None


def parse_models(text: str) -> tuple[str, ...]:
    from multigpu.train.models.model_names import model_input_kind

    models = tuple(dict.fromkeys(m.strip() for m in str(text).split(",") if m.strip()))
    if not models:
        raise UsageError("--model is empty; name a model, e.g. --model resnet50")
    for m in models:
        if model_input_kind(m) == "sequence":  # also raises UsageError on an unknown model
            raise UsageError(f"--model {m}: bench times models on image batches, and {m} takes timeseries windows; "
                             f"time it with `multigpu train --model {m} --data timeseries:co2` instead")
    return models


def validate(s: BenchSettings) -> None:
    for name in ("steps", "trials"):
        if getattr(s, name) < 1:
            raise UsageError(f"--{name} {getattr(s, name)} must be at least 1")
    if s.warmup < 0:
        raise UsageError(f"--warmup {s.warmup} must be 0 or more")
    if s.dp_steps is not None and s.dp_steps < 1:
        raise UsageError(f"--dp-steps {s.dp_steps} must be at least 1")
    if s.image_size is not None and s.image_size < 1:
        raise UsageError(f"--image-size {s.image_size} must be positive")
    if not s.data or any(k not in DATA_KINDS for k in s.data):
        raise UsageError(f"--data {','.join(s.data)}: choose from {','.join(DATA_KINDS)} "
                         "(or both: --data synthetic,real)")
    if s.compile and s.warmup < 1:
        raise UsageError("--compile compiles the model in the warm-up steps; use --warmup 1 or more")
    # GPUs unless CPU processes are asked for; runner.run checks again once "auto" is resolved
    compiling.check(s.compile, "cpu" if s.devices.startswith("cpu") else "cuda", "ddp")
    no_graphs = [m for m in s.methods if m in OURS and not strategy_of(m).cuda_graphs]
    if s.compile in compiling.CUDA_GRAPH_MODES and no_graphs:
        m = no_graphs[0]
        raise UsageError(f"--compile {s.compile} records CUDA graphs, which {m} cannot replay "
                         f"({strategy_of(m).help}): leave {m} out of --methods")


def gpu_counts(requested: tuple[int, ...] | None, available: int, unit: str,
               hint: str) -> tuple[int, ...]:
    """The counts to measure, checked against what the device plan offers."""
    if requested is None:
        counts = [n for n in (1, 2, 4, 8, 16, 32, 64) if n <= available] + [available]
        return tuple(sorted(set(counts)))
    too_many = [n for n in requested if n > available]
    if too_many:
        fix = ",".join(str(n) for n in requested if n <= available) or "1"
        raise UsageError(f"--gpus {','.join(map(str, requested))}: {too_many[0]} is more than the "
                         f"{available} {unit} available ({hint}); use --gpus {fix}")
    return tuple(sorted(requested))


# --------------------------------------------------------------------------- planning

def unavailable_reason(method: str, accelerator: str, data: str) -> str | None:
    """Why a peer or a DDP variant cannot run here on this data kind (one line), or None. The
    machine's reasons come first: they hold for every data kind, so a peer skipped for both kinds
    is named once."""
    if data == "real-gpu" and accelerator != "cuda":
        return "--data real-gpu decodes on GPUs; on CPU use --data real-cpu"
    variant = variant_of(method)
    if variant and variant.needs_nccl and accelerator != "cuda":
        if variant.bf16_hook:
            return "torch's bf16_compress_hook needs NCCL on GPUs (gloo refuses it)"
        return "NCCL's maxCTAs is a setting of NCCL communicators; gloo has none"
    if method not in PEERS:
        return None
    if method != "ddp" and accelerator != "cuda":
        return f"{method} is measured on GPUs only in this bench"
    if method == "accelerate" and importlib.util.find_spec("accelerate") is None:
        return f"accelerate is not installed: {install_hint('accelerate')}"
    fabric_packages = ("lightning", "lightning_fabric")
    if method == "fabric" and not any(importlib.util.find_spec(m) for m in fabric_packages):
        return f"lightning is not installed: {install_hint('lightning')}"
    if data in REAL_DECODE:
        return f"--data {data} times multigpu's own input pipeline; peers run on synthetic data only"
    return None


def plan_groups(s: BenchSettings, accelerator: str, counts: tuple[int, ...],
                inputs: dict[str, tuple[str, int]]) -> tuple[list[Group], list[dict]]:
    """Tasks grouped into launches (see the module docstring), and the methods skipped, with why.
    `inputs`: data kind -> (Task.data, num_outputs), as runner.prepare_data makes them."""
    skipped: dict[tuple[str, str], None] = {}
    on_gpu = accelerator == "cuda"
    first = Group(1, 1 if on_gpu else 0)
    ddp_groups = {n: Group(n, n if on_gpu else 0) for n in sorted(counts, reverse=True) if n > 1}
    dp = Group(1, 0)
    dp_steps = s.dp_steps or s.steps
    for kind in (k for k in DATA_KINDS if k in inputs):  # synthetic first in every group
        runnable = _runnable(s.methods, accelerator, kind, skipped)
        dp_counts = [n for n in counts if n > 1] if "multigpu-dp" in runnable else []
        for model in s.models:
            size = s.image_size or _default_image_size(model)
            for batch in s.batch_sizes:
                make = _TaskMaker(s, model, batch, size, *inputs[kind], REAL_DECODE.get(kind, "auto"))
                if "multigpu-single" in runnable:
                    first.tasks.append(make("multigpu-single", 1))
                first.tasks += [make(m, 1) for m in runnable if m in PEERS and 1 in counts]
                for n, group in ddp_groups.items():
                    group.tasks += [make(m, n) for m in runnable
                                    if m in PEERS or _process_per_gpu(base_method(m))]
                dp.tasks += [make("multigpu-dp", n, dp_steps, min(s.warmup, dp_steps))
                             for n in dp_counts]
    dp.visible = max((t.gpus for t in dp.tasks), default=0)
    groups = [g for g in (first, *ddp_groups.values(), dp) if g.tasks]
    planned = {t.method for g in groups for t in g.tasks}
    named = {m for m, _ in skipped}
    unit = "GPUs" if on_gpu else "CPU processes"
    for m in (m for m in s.methods if m not in planned and m not in named):  # 2+ devices only
        skipped[(m, f"{m} runs on 2 or more {unit}, and --gpus {','.join(map(str, counts))} asks "
                    f"for none: add a count of 2 or more to --gpus, or use multigpu-single for one")] = None
    return groups, [{"method": m, "reason": r} for m, r in skipped]


def _runnable(methods: tuple[str, ...], accelerator: str, kind: str,
              skipped: dict[tuple[str, str], None]) -> list[str]:
    """The methods that can run on this data kind here; the others go into `skipped`, with why."""
    runnable = []
    for m in methods:
        needs_gpus = m in OURS and strategy_of(m).needs_gpus and accelerator != "cuda"
        reason = (f"{strategy_of(m).help} needs GPUs; on CPU use multigpu-ddp" if needs_gpus
                  else unavailable_reason(m, accelerator, kind))
        if reason:
            skipped[(m, reason)] = None
        else:
            runnable.append(m)
    return runnable


def strategy_of(method: str):
    """The registry entry of a multigpu-<strategy> method."""
    return STRATEGIES[base_method(method).removeprefix(OURS_PREFIX)]


def _process_per_gpu(method: str) -> bool:
    """multigpu-ddp, its variants, multigpu-fsdp: run in the launches of N processes."""
    return method in OURS and not strategy_of(method).one_process


@dataclass
class _TaskMaker:
    s: BenchSettings
    model: str
    batch: int
    size: int
    data: str
    num_outputs: int
    decode: str

    def __call__(self, method: str, n: int, steps: int | None = None,
                 warmup: int | None = None) -> Task:
        s = self.s
        return Task(method, self.model, self.batch, n, self.size, s.precision, self.data,
                    self.num_outputs, s.warmup if warmup is None else warmup,
                    steps or s.steps, s.trials,
                    compile=s.compile if base_method(method) in OURS else None, decode=self.decode)


def _default_image_size(model: str) -> int:
    from multigpu.train.models.model_names import default_image_size

    return default_image_size(model)
