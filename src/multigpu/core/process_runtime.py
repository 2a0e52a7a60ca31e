"""The Runtime: one training process's view of the run, made by `multigpu.setup()`.

It holds explicit state only: the DistEnv, the Strategy, the Precision, and the StepInfo of the
batch the prepared loader yielded last. `multigpu.core.runtime` builds it (setup) and is the
import path users know for both.
"""
from __future__ import annotations

import atexit
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from multigpu.core.checkpoints import runtime_checkpoints
from multigpu.core import loggers as run_loggers
from multigpu.core.loading.data import StepInfo
from multigpu.core.loading.loaders import shard_loader
from multigpu.core.distributed import DistEnv
from multigpu.core.errors import UsageError
from multigpu.core.loading.global_batch import BatchPlan, plan_batch
from multigpu.core.loading.global_batch_sampler import shard_global
from multigpu.core.guards import Bypass
from multigpu.core.precision import Precision
from multigpu.core.strategies import Strategy
from multigpu.core.stragglers import Stragglers


class Runtime:
    """A training process's view of the run: its DistEnv, Strategy and Precision, made by `setup()`.

    It wraps what a loop needs around the user's own objects: `prepare()` the model, optimizer and
    loaders; `autocast()`, `backward()` and `step()` in the loop; `save()` and `load()` for
    checkpoints; `print()` on rank 0. Attributes: `env` (DistEnv), `strategy`, `precision`
    (Precision), `step_info` (StepInfo of the batch the prepared loader yielded last),
    `stragglers` (each rank's own time of every epoch and the rank that holds the others back:
    `rt.stragglers.take()` after an epoch gives (every rank's figures, the sentence or None)).
    """

    def __init__(self, env: DistEnv, strategy: Strategy, precision: Precision, *, seed: int = 0,
                 accumulate: int = 1, log_to: tuple[Path, tuple[str, ...]] | None = None):
        self.env, self.strategy, self.precision = env, strategy, precision
        self.seed, self.accumulate = seed, accumulate
        self.step_info: StepInfo | None = None  # set by prepared loaders before each batch
        self.global_batch: int | None = None  # setup(global_batch_size=G)
        self.batch_plan: BatchPlan | None = None  # G's plan, from the first loader prepared
        self._models: list[nn.Module] = []
        self._replaced: dict[int, weakref.ref] = {}  # parameters a strategy replaced (fsdp)
        self._stepped: set[int] = set()  # optimizers rt.step has checked
        self._unused_checked = False
        self._log_to = log_to  # (folder, logger names): setup(log_dir=, loggers=)
        self._logs = None
        self._log_step = 0
        self._bypass = Bypass(env.is_main)  # loss.backward() / optimizer.step() around the runtime
        self.stragglers = Stragglers(env, strategy.device)  # which rank holds the others back

    # --- convenience views ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device of this process (`cuda:LOCAL_RANK`, or `cpu`); batches arrive on it."""
        return self.strategy.device

    @property
    def rank(self) -> int:
        """This process's global rank, 0..world_size-1."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """How many processes take part (1 without a launcher)."""
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        """True on rank 0, the process that prints and writes files."""
        return self.env.is_main

    def print(self, *args, **kwargs) -> None:
        """print() on rank 0 only (flushed at once); the other ranks print nothing."""
        if self.env.is_main:
            print(*args, **kwargs, flush=True)

    def log(self, values: dict, step: int | None = None) -> None:
        """Write scalars (numbers or 0-d tensors) at `step` (default: one more than the last) to
        the loggers of `setup(log_dir=...)`: TensorBoard events and LOG_DIR/metrics.csv. Rank 0
        only; the other ranks return at once, so reduce a value first if it should cover them.

            rt = multigpu.setup(log_dir="runs/my-run")
            rt.log({"train/loss": loss, "train/lr": optimizer.param_groups[0]["lr"]}, step=step)
        """
        if self._log_to is None:
            raise UsageError("rt.log() needs a folder to write to: multigpu.setup(log_dir='runs/NAME')")
        step = self._log_step + 1 if step is None else int(step)
        self._log_step = step
        if not self.env.is_main:
            return
        if self._logs is None:
            folder, names = self._log_to
            self._logs = run_loggers.open_loggers(names, folder, csv_name="metrics.csv")
            atexit.register(self._logs.close)
        self._logs.log(step, values)

    def __repr__(self) -> str:
        return (f"Runtime(rank={self.rank}, world_size={self.world_size}, device={self.device}, "
                f"strategy={self.strategy.describe()}, precision={self.precision.kind})")

    # --- prepare ----------------------------------------------------------------------------------
    def prepare(self, *objects):
        """Prepare models, optimizers and data loaders, returned in the order given.

        Models move to the device and are wrapped (DataParallel/DDP/FSDP) *after* their weights
        are in place. Loaders are rebuilt so each rank gets its exact share and batches arrive on
        the device. Optimizers and schedulers pass through (parameters keep their identity when
        moved); an optimizer stepped directly (`optimizer.step()`, not `rt.step`) warns once, as
        does a `loss.backward()` that `rt.step` finds instead of `rt.backward`.

        objects: nn.Module, torch.optim.Optimizer, LR scheduler, DataLoader, or a function that
        makes the optimizer from the parameters of the model before it (`lambda params:
        torch.optim.AdamW(params, lr=1e-3)`: the way for fsdp, which replaces the parameters
        with their shards), in any order. Returns them prepared, one object alone or a tuple.
        Give the DataLoader `batch_size` per device and `shuffle=True` for training: each epoch
        is reshuffled, with no `set_epoch` to call. Raises UsageError for an already wrapped
        model, an optimizer that holds none of the prepared model's parameters, or an object it
        does not know.

            model, optimizer, train_loader = rt.prepare(model, optimizer, train_loader)
            model, optimizer = rt.prepare(model, lambda params: torch.optim.AdamW(params))
        """
        # models first, so that an optimizer or a factory anywhere in the call sees them prepared
        out = [self._prepare_model(o) if isinstance(o, nn.Module) else o for o in objects]
        models = [(i, m) for i, m in enumerate(out) if isinstance(objects[i], nn.Module)]
        for i, obj in enumerate(objects):
            if isinstance(obj, nn.Module):
                continue
            if isinstance(obj, DataLoader):
                out[i] = self.prepare_loader(obj)
            elif isinstance(obj, torch.optim.Optimizer):
                self._check_optimizer(obj)
                self._bypass.watch(obj)  # a direct optimizer.step() warns once
            elif hasattr(obj, "step"):
                pass  # an LR scheduler
            elif callable(obj):
                before = [m for j, m in models if j < i]
                after = [m for j, m in models if j > i]
                nearest = before[-1] if before else after[0] if after else (
                    self._models[-1] if self._models else None)
                out[i] = self._make_optimizer(obj, nearest)
            else:
                raise UsageError(f"prepare() got a {type(obj).__name__}; it takes models, "
                                 "optimizers (or a function that makes one), LR schedulers and "
                                 "DataLoaders")
        return out[0] if len(out) == 1 else tuple(out)

    def _make_optimizer(self, factory, model: nn.Module | None) -> torch.optim.Optimizer:
        """`factory` called with the trainable parameters of `model` (the nearest model of the
        prepare() call, before it first)."""
        if model is None:
            raise UsageError("prepare() got a function to make the optimizer but no model: "
                             "rt.prepare(model, make_optimizer)")
        model = self.strategy.unwrap(model)
        optimizer = factory([p for p in model.parameters() if p.requires_grad])
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise UsageError(f"the function given to prepare() returned a "
                             f"{type(optimizer).__name__}; it must return a torch.optim.Optimizer "
                             "built on the parameters it is given")
        self._bypass.watch(optimizer)
        return optimizer

    def _check_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer built on parameters that the strategy replaced (fsdp shards them) would
        step tensors the model no longer uses: the run would train nothing, silently."""
        stale = [p for g in optimizer.param_groups for p in g["params"]
                 if (ref := self._replaced.get(id(p))) is not None and ref() is p]
        if stale:
            raise UsageError(
                f"the optimizer holds {len(stale)} parameter(s) that strategy "
                f"'{self.strategy.name}' replaced when it prepared the model: stepping them "
                "would train nothing. Build the optimizer after prepare() from "
                "model.parameters(), or pass prepare() a function that makes it: "
                "rt.prepare(model, lambda params: torch.optim.AdamW(params))")

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        if isinstance(model, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
            raise UsageError("prepare() got a model already wrapped in DataParallel/DDP; pass the "
                             "bare model and let the strategy wrap it (setup(strategy='dp') or "
                             "'ddp')")
        before = list(model.parameters())
        wrapped = self.strategy.setup_module(model)
        kept = {id(p) for p in self.strategy.unwrap(wrapped).parameters()}
        self._replaced.update((id(p), weakref.ref(p)) for p in before if id(p) not in kept)
        wrapped.register_forward_pre_hook(_warn_eval_with_grad)
        self.stragglers.watch(wrapped)
        self._models.append(wrapped)
        return wrapped

    def prepare_loader(self, loader: DataLoader, *, drop_last: bool | None = None):
        """`prepare()` for one DataLoader, with `drop_last` overriding the loader's own setting.

        The returned loader yields this rank's share of every global step (batch_size samples per
        device, every sample once per epoch, the same number of steps on every rank), moved to
        the device. With setup(global_batch_size=G), G samples per optimizer step instead, the
        loader's batch_size the largest per device (multigpu.core.loading.global_batch)."""
        if self.global_batch is not None:
            prepared = self._prepare_global(loader, drop_last)
        else:
            prepared = shard_loader(loader, layout=self._layout(), device=self.device,
                                    seed=self.seed, on_step=self._on_step,
                                    accumulate=self.accumulate, drop_last=drop_last)
        if self.stragglers.counts(prepared):
            prepared.watch = self.stragglers
        return prepared

    def _prepare_global(self, loader: DataLoader, drop_last: bool | None):
        devices = self.env.world_size * self.strategy.devices_per_process
        plan = plan_batch(self.global_batch, devices, loader.batch_size or 1)
        if self.batch_plan is None:  # the training loader's (prepared first) sets the accumulation
            self.batch_plan, self.accumulate = plan, plan.accumulate
        return shard_global(loader, plan, layout=self._layout(), device=self.device, seed=self.seed,
                            on_step=self._on_step, drop_last=drop_last)

    def _layout(self) -> tuple[int, int, int]:
        """(ranks, this rank, devices per rank): how the loaders share out a step's batch."""
        return self.env.world_size, self.env.rank, self.strategy.devices_per_process

    def _on_step(self, info: StepInfo | None) -> None:
        self.step_info = info  # None once a loader is exhausted: no stale weights afterwards
        # with a global batch, an epoch's last step can take more micro-batches than the others
        if (self.accumulate > 1 or self.global_batch is not None) and info is not None:
            for model in self._models:
                self.strategy.set_grad_sync(model, info.sync)

    def sync_buffers(self, model: nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm running statistics, ...). Collective: call
        it on every rank. With DDPOptions(broadcast_buffers=False) each rank's buffers follow its
        own data; call this before evaluating on every rank, so each evaluates the model that
        rank 0 saves. A no-op in one process."""
        self.env.broadcast_tensors(list(self.strategy.unwrap(model).buffers()))

    # --- the training step ------------------------------------------------------------------------
    def autocast(self):
        """The context for the forward pass: autocast to bf16/fp16, or nothing for fp32.

        Put the forward pass and the loss inside it, and the backward outside:

            with rt.autocast():
                loss = loss_fn(model(x), y)
            rt.backward(loss)
        """
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a loss averaged over this rank's batch.

        The loss is reweighted so that the gradient, once DDP averages it over ranks, is the mean
        over the real samples of the whole optimizer step: exact when ranks hold different numbers
        of samples (the last step) and over accumulated micro-batches.
        """
        info = self.step_info
        if info is not None:
            weight = info.local_count * self.env.world_size / info.window_count
            if weight != 1.0:
                loss = loss * weight
        elif self.accumulate > 1 or self.global_batch is not None:
            given = "global_batch_size=G" if self.global_batch is not None else "accumulate=N"
            raise UsageError(f"setup({given}) counts micro-batches through the loaders that "
                             "rt.prepare() returns; this batch came from elsewhere: prepare the "
                             "training DataLoader, or use accumulate=1")
        self.precision.backward(loss)
        self._bypass.backwards += 1
        if not self._unused_checked:
            self._unused_checked = True
            self.strategy.check_unused(self._models)

    def step(self, optimizer: torch.optim.Optimizer, clip_grad_norm: float | None = None) -> bool:
        """Unscale (fp16), clip, step and zero the gradients. False on accumulation micro-steps.

        clip_grad_norm: clip the global gradient norm to this value (on true, unscaled gradients).
        Returns True when the optimizer stepped; with setup(accumulate=N), False on the micro-steps
        that only add gradients. With fp16 the scaler may skip a step whose gradients hold inf/NaN
        (`rt.precision.skipped_steps` counts them).
        """
        if self.step_info is not None and not self.step_info.sync:
            return False
        if id(optimizer) not in self._stepped:  # once per optimizer: one not given to prepare()
            self._check_optimizer(optimizer)
            self._stepped.add(id(optimizer))
        self._bypass.check_step(optimizer)  # gradients rt.backward did not make: warned once
        if clip_grad_norm is not None:
            self.precision.unscale(optimizer)  # clip the true gradients, not the scaled ones
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        with self._bypass.stepping():
            self.precision.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        return True

    # --- checkpoints ------------------------------------------------------------------------------
    def save(self, path: str | Path, *, model: nn.Module, optimizer=None, scheduler=None,
             sharded: bool = False, **extra) -> None:
        """Save a checkpoint. Collective: call on every rank. Rank 0 writes `path` atomically;
        all ranks then wait, and all of them raise if the write failed.

        The file holds the model's bare state dict (no `module.` prefix: it loads into an
        unwrapped model), the optimizer's and scheduler's state, the precision's (GradScaler),
        every rank's RNG state and the `extra` values (int, float, str, lists, dicts, tensors).
        sharded=True (for fsdp's large models): every rank writes its own part of the model and
        optimizer state into a folder beside `path` (torch.distributed.checkpoint) and nothing
        is gathered onto rank 0; `path` then holds the rest and names the folder. `rt.load(path)`
        reads it on any number of processes; `multigpu export path` makes one file of it.

            rt.save("checkpoints/last.pt", model=model, optimizer=optimizer, epoch=epoch)
        """
        runtime_checkpoints.save(self, path, model=model, optimizer=optimizer, scheduler=scheduler,
                                 sharded=sharded, **extra)

    def checkpoint_state(self, model: nn.Module, optimizer=None, scheduler=None, *,
                         weights: bool = True, **extra) -> dict | None:
        """Collective (every rank's RNG is gathered). On rank 0 the checkpoint as a dict, its
        tensors where they live (copy them before training goes on); None on the other ranks.
        weights=False leaves the model's and optimizer's state out (saved sharded beside it)."""
        return runtime_checkpoints.checkpoint_state(self, model, optimizer, scheduler, weights=weights,
                                                    **extra)

    def load(self, path: str | Path | dict, *, model: nn.Module | None = None, optimizer=None,
             scheduler=None, shards_dir: str | Path | None = None) -> dict:
        """Restore what `save` wrote (from any strategy), from a file or an already loaded
        checkpoint dict; returns the whole checkpoint dict.

        Call it on every rank. The file is read with `weights_only=True` (no pickled code runs);
        one that is missing, truncated or not a checkpoint raises CheckpointError (a UsageError)
        naming the cause. The model may be wrapped or bare, and saved from another strategy or
        world size; each rank gets back its RNG streams when the world size is the same. A
        checkpoint of `multigpu train --strategy fsdp` keeps its model and optimizer state in a
        folder of shards beside the file (found from the file; give `shards_dir` with a dict),
        read into the prepared model and optimizer whatever their strategy and world size.

            state = rt.load("checkpoints/last.pt", model=model, optimizer=optimizer)
            start_epoch = state["epoch"] + 1
        """
        return runtime_checkpoints.load(self, path, model=model, optimizer=optimizer,
                                        scheduler=scheduler, shards_dir=shards_dir)


def _warn_eval_with_grad(module: nn.Module, _args) -> None:
    """Trap 2: evaluating with autograd on keeps every activation alive, a common OOM."""
    if not module.training and torch.is_grad_enabled():
        warnings.warn("the model ran in eval mode with gradients enabled, which keeps activations "
                      "in memory for nothing; wrap validation in torch.no_grad()", stacklevel=2)
