"""Where a run starts from and how often and how many checkpoints it keeps, as one checked value;
`checkpoint_every` is read (a step count or a time) when the value is made."""
from __future__ import annotations

from dataclasses import dataclass

from multigpu.core.options import Flag, check_options, option
from multigpu.train.control import Cadence


@dataclass(frozen=True)
class CheckpointConfig:
    resume: str | None = option(None, "continue from a checkpoint file or a run folder (its "
                                      "newest readable checkpoint), from any strategy or device "
                                      "count, inside an epoch too; the run goes on in that folder "
                                      "unless --out is given (running the same command again "
                                      "continues in --out)")
    checkpoint_every: str = option("10m", "also checkpoint inside epochs: every N steps (500), "
                                          "or every so long (30s, 10m, 2h); 0: at the end of "
                                          "each epoch only", flag=Flag("N|TIME"))
    keep: int = option(3, "checkpoints kept: the N newest, plus best.pt", at_least=1)

    def __post_init__(self):
        check_options(self)
        self.cadence()

    def cadence(self) -> Cadence:
        """When to checkpoint inside an epoch, read from `checkpoint_every`."""
        return Cadence.parse(self.checkpoint_every)
