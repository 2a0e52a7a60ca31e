"""How the weights are stepped: the optimizer, its learning-rate schedule, gradient accumulation
and clipping, as one checked value (training.make_optimizer and make_scheduler build them)."""
from __future__ import annotations

from dataclasses import dataclass

from multigpu.core.loading.global_batch import check_global_batch
from multigpu.core.options import Flag, check_options, option


@dataclass(frozen=True)
class OptimConfig:
    lr: float | None = option(None, "learning rate (default: 0.05 for sgd, 1e-3 for adam/adamw)",
                              above=0, example=0.001)
    optimizer: str = option("adamw", "optimizer", choices=("sgd", "adam", "adamw"))
    weight_decay: float = option(0.0, "weight decay", at_least=0, example=0.01)
    scheduler: str = option("none", "learning-rate schedule, stepped once per epoch",
                            choices=("none", "step", "cosine"))
    step_size: int = option(5, "--scheduler step: epochs between decays (post 001 used 5)",
                            at_least=1)
    gamma: float = option(0.9, "--scheduler step: decay factor (post 001 used 0.9)",
                          above=0, example=0.9)
    accumulate: int = option(1, "micro-batches per optimizer step (gradients all-reduced on the "
                                "last only)", at_least=1)
    clip_grad_norm: float | None = option(None, "clip the global gradient norm to this value",
                                          above=0, example=1.0)
    global_batch_size: int | None = option(None, "samples per optimizer step over all devices, "
                                                 "the same on any device count: --batch-size "
                                                 "(or auto) is then the largest per device, and "
                                                 "the accumulation makes up the rest; a resume "
                                                 "on other devices keeps it", at_least=1,
                                           flag=Flag("G"), example=256)

    def __post_init__(self):
        check_options(self)
        check_global_batch(self.global_batch_size, self.accumulate)  # not beside --accumulate

    @property
    def learning_rate(self) -> float:
        """`lr`, or the optimizer's usual one when it is not given."""
        return self.lr if self.lr is not None else (0.05 if self.optimizer == "sgd" else 1e-3)
