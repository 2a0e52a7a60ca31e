"""The strategy a run asks for and the options that go with it, as one checked value.

`multigpu train` builds it from its flags (train/settings/config.py); the run turns it into the strategy's
own options objects (DDPOptions, FSDPOptions). An option that only one strategy reads
(registry.StrategyInfo.flags) is refused with another here, when the value is made.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from multigpu.core.errors import Api, Text, UsageError
from multigpu.core.options import check_options, option
from multigpu.core.strategies import registry


@dataclass(frozen=True)
class StrategyConfig:
    strategy: str = option("auto", registry.HELP, choices=registry.NAMES)
    find_unused_parameters: bool = option(False, "let DDP search for parameters the loss does not "
                                                 "use (slower; the default reports them by name "
                                                 "instead)")
    fsdp_cpu_offload: bool = option(False, "--strategy fsdp: keep the shards of parameters, "
                                           "gradients and optimizer state in host memory (the "
                                           "optimizer steps on the CPU): for models whose shards "
                                           "do not fit the GPUs")
    activation_checkpointing: bool = option(False, "--strategy fsdp: recompute each block's "
                                                   "activations in the backward instead of keeping "
                                                   "them (about 1/3 more compute, much less memory)")

    def __post_init__(self):
        check_options(self)
        self._check_owners()

    def _check_owners(self) -> None:
        """Refuse an option that another strategy alone reads (it would be ignored silently)."""
        own = registry.info(self.strategy).flags
        for name in sorted(f.name for f in fields(self) if getattr(self, f.name) is True):
            owners = [s.name for s in registry.STRATEGIES.values() if name in s.flags]
            if owners and name not in own:
                option_api = Api(f"StrategyConfig.{name}", True,
                                 text=f"StrategyConfig({name}=True)")
                raise UsageError(Text("{} is an option of {}, not of {}; add {}, or leave it out",
                                      option_api, _strategy(owners[0]), _strategy(self.strategy),
                                      _strategy(owners[0])))


def _strategy(name: str) -> Api:
    return Api("StrategyConfig.strategy", name)
