"""A user's training script read, never run nor imported, for the traps its source shows.

Python is read with `ast` (the checks of its DataParallel/DDP wrappers are in wrapper_checks.py);
a shell script (not .py, no python shebang) by shell_checks.py. Names are followed only through
simple bindings (`model = nn.DataParallel(net)`), in line order, with no scopes: a name rebound
in any other way, a function parameter included, is unknown again.
Every check stays silent when it cannot tell: a false alarm teaches users to skip the doctor.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from multigpu.core.findings import Finding
from multigpu.doctor.pysource import Source, code, const, dotted, kw, method
from multigpu.train.checks.setup_checks import LAUNCH_VARS
from multigpu.doctor.shell_checks import is_python, shell_findings
from multigpu.doctor.wrapper_checks import wrapper_findings
from multigpu.launcher.scripts import LOCAL_RANK_FLAGS, detect_local_rank_flag

_MODEL_METHODS = ("parameters", "named_parameters", "state_dict", "load_state_dict", "eval", "train")
_LAUNCHERS = {"accelerate": "an Accelerate", "lightning": "a Lightning",
              "pytorch_lightning": "a PyTorch Lightning"}


def script_findings(path: Path, *, nproc: int, gpus: bool, master_port: int | None = None) -> list[Finding]:
    """Findings for a Python script (or a shell script) to be started `nproc` times, one process
    per device (gpus: whether the devices are GPUs; master_port: the launch's --master-port, if
    given). Sorted by line."""
    data = path.read_bytes()
    if is_python(path, data):
        found = _python_findings(path, data, nproc=nproc, gpus=gpus, master_port=master_port)
    else:
        found = shell_findings(path, data)
    found = found or [Finding("ok", "script", "no known trap in the source")]
    return sorted(found, key=lambda f: int(f.where.rsplit(":", 1)[1]) if f.where else 0)


# --- Python: the checks -------------------------------------------------------------------------

def syntax_error(path: Path, data: bytes) -> tuple[str, str] | None:
    """(file:line, Python's reason) where Python cannot parse the script, else None."""
    try:
        ast.parse(data, filename=str(path))
    except (SyntaxError, ValueError) as e:  # ValueError: a null byte
        return f"{path}:{getattr(e, 'lineno', None) or 1}", str(getattr(e, "msg", e))
    return None


def syntax_finding(path: Path, data: bytes, nproc: int) -> Finding | None:
    """A fail when Python cannot parse the script (every process would die at start), else None."""
    found = syntax_error(path, data)
    if found is None:
        return None
    where, why = found
    return Finding("fail", "syntax", f"Python cannot parse it ({why}), so all {nproc} processes "
                   "would die at start; fix this line (a Python 2 script needs porting)", where=where)


def _python_findings(path: Path, data: bytes, *, nproc: int, gpus: bool,
                     master_port: int | None = None) -> list[Finding]:
    if (unparsable := syntax_finding(path, data, nproc)) is not None:
        return [unparsable]
    tree = ast.parse(data, filename=str(path))
    src = Source(path, tree, data.decode(errors="replace"))
    return [*_launch_env(src, master_port), *_spawn(src, nproc), *wrapper_findings(src, nproc, gpus),
            *(_sampler(src, nproc) if nproc > 1 else []), *_precision(src), *_local_rank(src),
            *_launchers(src), *_no_process_group(src, nproc)]


def _env_writes(src: Source):
    """(node, variable, value) for each os.environ[...] = v, os.environ.update(...), os.putenv."""
    for node in src.nodes:
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and src.qualname(t.value) == "os.environ":
                    yield node, const(t.slice), node.value
        elif isinstance(node, ast.Call):
            name = src.qualname(node.func)
            if name == "os.putenv" and len(node.args) == 2:
                yield node, const(node.args[0]), node.args[1]
            elif name == "os.environ.update":
                pairs = [(k.arg, k.value) for k in node.keywords]
                if node.args and isinstance(node.args[0], ast.Dict):
                    pairs += [(const(k), v) for k, v in zip(node.args[0].keys, node.args[0].values)]
                yield from ((node, k, v) for k, v in pairs)


_FATAL_VARS = ("MASTER_PORT", "WORLD_SIZE", "RANK")  # a run that sets these itself cannot meet


def _launch_env(src: Source, master_port: int | None = None) -> list[Finding]:
    """Trap 8: launch variables the script sets itself, or a hard-coded rendezvous."""
    found = []
    for node, var, value in _env_writes(src):
        if any(const(n) == var for n in ast.walk(value)):
            continue  # os.environ[var] = os.environ.get(var, default): a default, like setdefault
        if src.in_launch_guard(node.lineno):
            continue  # only when no launcher set it (if "RANK" not in os.environ: ...)
        if var == "MASTER_PORT" and master_port is not None and const(value) == str(master_port):
            continue  # the port the launch was given: the same store
        if var == "MASTER_PORT":
            found.append(src.at("fail", "launch env", node, f"sets MASTER_PORT={code(value)}: "
                                "multigpu run hosts the rendezvous on a port of its own, so every "
                                "rank would wait there for a store nobody hosts (a hang); delete "
                                f"the line, or launch with --master-port {const(value) or 'PORT'}",
                                trap=8))
        elif var in LAUNCH_VARS:
            level = "fail" if var in _FATAL_VARS else "warn"
            found.append(src.at(level, "launch env", node, f"sets {var}={code(value)}; under "
                                "multigpu run the launcher sets it for every process and ranks that "
                                "disagree never meet (a hang): delete the line", trap=8))
        elif var == "CUDA_VISIBLE_DEVICES":
            found.append(src.at("warn", "launch env", node, f"sets CUDA_VISIBLE_DEVICES={code(value)}"
                                ", overriding the GPUs multigpu run chose (free ones): delete the "
                                "line and choose them with multigpu run --devices 0,3", trap=13))
    for call in src.calls:
        if src.qualname(call.func).endswith("init_process_group"):
            found += _init_process_group(src, call)
    return found


def _init_process_group(src: Source, call: ast.Call) -> list[Finding]:
    method = const(kw(call, "init_method"))
    tcp = isinstance(method, str) and method.startswith("tcp://")
    hard = [f"init_method={method!r}"] if tcp else []
    hard += [f"{k}={const(kw(call, k))}" for k in ("world_size", "rank")
             if isinstance(const(kw(call, k)), int)]
    if not hard:
        return []
    return [src.at("warn", "launch env", call, f"init_process_group({', '.join(hard)}) is hard-coded, "
                   "so it disagrees with what multigpu run gives each process (a hang, or Address "
                   "already in use); fix: init_process_group(backend), which reads the environment, "
                   "or multigpu.setup()", trap=8)]


_SPAWNS = ("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes",
           "torch.multiprocessing.spawn.spawn")


def _spawn(src: Source, nproc: int) -> list[Finding]:
    """A script that starts its own processes (pytorch/examples' DDP tutorial: mp.spawn over every
    GPU, each calling init_process_group with its own rank): under a launcher of N processes,
    each starts a whole job of its own."""
    found = []
    for call in src.calls:
        if src.qualname(call.func) not in _SPAWNS or src.in_launch_guard(call.lineno):
            continue  # `if "LOCAL_RANK" in os.environ: main() else: mp.spawn(...)` is fine
        level = "fail" if nproc > 1 else "warn"
        each = f"each of the {nproc} processes" if nproc > 1 else "the process"
        found.append(src.at(level, "launch env", call, f"{dotted(call.func)}(...) starts processes of "
                            f"its own: under multigpu run {each} would start "
                            "a whole job (ranks that clash, GPUs used twice); fix: start it with "
                            "python (as it is written), or drop the spawn and take the rank from "
                            "RANK / LOCAL_RANK / WORLD_SIZE, which multigpu run sets", trap=8))
    return found


def _sampler(src: Source, nproc: int) -> list[Finding]:
    """A DistributedSampler never reshuffled, or one that pads the validation set (trap 3)."""
    samplers = [c for c in src.calls if src.qualname(c.func).endswith("DistributedSampler")]
    shuffled = [c for c in samplers if const(kw(c, "shuffle")) is not False]
    found = []
    if shuffled and not any(method(c) == "set_epoch" for c in src.calls):
        found.append(src.at("warn", "sampler", shuffled[0], "DistributedSampler without set_epoch: "
                            "every epoch sees the same order; fix: sampler.set_epoch(epoch) before "
                            "each epoch"))
    for c in (c for c in samplers if c not in shuffled):
        what = (f"drops up to {nproc - 1} samples" if const(kw(c, "drop_last")) is True
                else f"pads it with repeats and counts up to {nproc - 1} samples twice")
        found.append(src.at("warn", "sampler", c, "DistributedSampler(shuffle=False), typically for "
                            f"validation: when the set's size is not a multiple of {nproc} it {what}; "
                            "fix: evaluate on rank 0 only, or multigpu's rt.prepare(val_loader), "
                            "which shards exactly", trap=3))
    return found


def _fp16_autocast(src: Source, call: ast.Call) -> bool:
    """An autocast to float16: the default of torch.cuda.amp.autocast and of autocast('cuda')."""
    name = src.qualname(call.func)
    if name.rsplit(".", 1)[-1] != "autocast" or const(kw(call, "enabled")) is False or "cpu." in name:
        return False
    if "cuda.amp" in name:
        device, dtype = "cuda", kw(call, "dtype")
    else:
        device = const(call.args[0] if call.args else kw(call, "device_type"))
        dtype = call.args[1] if len(call.args) > 1 else kw(call, "dtype")
    fp16 = (dotted(dtype) or "").rsplit(".", 1)[-1] in ("float16", "half")
    if isinstance(device, str):  # a CPU autocast defaults to bf16, a CUDA one to fp16
        return device.startswith("cuda") and (dtype is None or fp16)
    return fp16  # a device in a variable: fp16 only when the dtype says so


def _precision(src: Source) -> list[Finding]:
    """fp16 with no GradScaler, and apex (trap 7)."""
    found = []
    if "apex" in src.imported:
        found.append(src.at("warn", "precision", src.imported["apex"], "imports apex: its amp is "
                            "unmaintained and often will not build; fix: torch.amp: with "
                            "torch.autocast('cuda', dtype=torch.bfloat16), or float16 with "
                            "torch.amp.GradScaler()", trap=7))
    if "GradScaler" in src.text:  # even in a comment: unsure, so silent
        return found
    models = {dotted(c.func.value) for c in src.calls if method(c) in _MODEL_METHODS} - {None}
    autocast = next((c for c in src.calls if _fp16_autocast(src, c)), None)
    half = next((c for c in src.calls if method(c) == "half" and not c.args
                 and dotted(c.func.value) in models), None)
    if autocast:
        found.append(src.at("warn", "precision", autocast, "fp16 autocast with no GradScaler: small "
                            "gradients underflow to zero; fix: scaler = torch.amp.GradScaler(), then "
                            "scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); or "
                            "dtype=torch.bfloat16", trap=7))
    elif half:
        found.append(src.at("warn", "precision", half, f"{code(half)} trains in pure fp16 with no "
                            "GradScaler: small gradients underflow to zero; fix: keep the model fp32 "
                            "under torch.autocast('cuda', dtype=torch.bfloat16), or float16 with "
                            "torch.amp.GradScaler()", trap=7))
    return found


def _local_rank(src: Source) -> list[Finding]:
    """Trap 15: a script written for torch.distributed.launch parses --local_rank."""
    mode = detect_local_rank_flag(src.text)
    if mode == "none":
        return []
    flag = LOCAL_RANK_FLAGS[mode]
    line = next((i for i, s in enumerate(src.text.splitlines(), 1) if flag in s), 1)
    return [Finding("ok", "local rank", f"parses {flag} (written for torch.distributed.launch): "
                    f"multigpu run passes {flag}=<local rank> to each process (--local-rank-arg none "
                    "to stop); reading os.environ['LOCAL_RANK'] needs no flag", trap=15,
                    where=f"{src.path}:{line}")]


def _launchers(src: Source) -> list[Finding]:
    """Scripts of another framework: multigpu run gives them torchrun's environment."""
    return [src.at("ok", "launcher", src.imported[package], f"{what} script: multigpu run starts one "
                   "process per device with torchrun's environment, which it reads")
            for package, what in _LAUNCHERS.items() if package in src.imported]


# A script that forms a process group, or may: torch.distributed in any form, a launch variable
# read, or a library that forms one itself (Accelerate, Lightning, multigpu.setup, HF Trainer...)
_GROUP_WORDS = re.compile(r"(?i:distributed)|init_process_group|init_device_mesh|\bDDP\b|FSDP|"
                          r"fully_shard|LOCAL_RANK|local_rank|WORLD_SIZE|\bRANK\b")
_GROUP_LIBRARIES = ("accelerate", "lightning", "pytorch_lightning", "multigpu", "transformers",
                    "deepspeed", "horovod", "ray", "ignite", "composer", "colossalai", "fairscale",
                    "mmengine", "torchtnt")


def _trains(src: Source, call: ast.Call) -> bool:
    """An optimizer built, a DataLoader built or a backward: the source trains."""
    name = src.qualname(call.func)
    last = name.rsplit(".", 1)[-1]
    return (name.startswith("torch.optim.") and ".lr_scheduler." not in name and last[:1].isupper()
            or last == "DataLoader" or method(call) == "backward")


def _no_process_group(src: Source, nproc: int) -> list[Finding]:
    """A one-device training script started N times: N independent whole trainings, each
    writing the same files, and nothing would say so. Said, not refused (N copies may be meant)."""
    if nproc < 2 or _GROUP_WORDS.search(src.text) or any(p in src.imported for p in _GROUP_LIBRARIES):
        return []
    if not any(_trains(src, c) for c in src.calls):
        return []
    name = src.path.name
    return [Finding("warn", "process group", f"{name} forms no process group (no torch.distributed."
                    f"init_process_group): each of the {nproc} processes runs the whole script "
                    f"alone, {nproc} independent full trainings that each write the same files; "
                    f"run it with --auto to make it data-parallel unmodified (multigpu run --auto "
                    f"{src.path})")]
