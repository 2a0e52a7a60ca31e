"""How `multigpu train` (and bench, doctor) says the library's API names: as its flags.

The library's errors name its API (`setup(strategy='ddp')`, errors.Text); a user of the command
line never wrote that call, so the commands say the same message with the flag that sets the same
thing (`--strategy ddp`). This table is the one place that knows which flag sets which argument;
a name missing from it is said as the library says it.
"""
from __future__ import annotations

from multigpu.core.errors import Api, Text
from multigpu.train.settings.config import flag_forms

# Api.name -> the flag; "{}" takes the value to pass, a flag without it is said alone.
FLAGS = {
    "setup.strategy": "--strategy {}",
    "setup.precision": "--precision {}",
    "setup.accumulate": "--accumulate {}",
    "setup.global_batch_size": "--global-batch-size {}",
    "setup.accelerator": "--devices cpu:N",  # the CPU: CPU processes at launch
    "compile_model.mode": "--compile {}",
    "DataLoader.batch_size": "--batch-size",
    "DDPOptions.find_unused_parameters": "--find-unused-parameters",
    "FSDPOptions.cpu_offload": "--fsdp-cpu-offload",
    "launch.devices": "--devices {}",
    # the settings' own names (StrategyConfig.strategy, DataConfig.batch_size): their flags
    **flag_forms(),
}


def flag(api: Api) -> str:
    """`api` as the command line says it: its flag (with the value), or the library's words."""
    form = FLAGS.get(api.name)
    if form is None:
        return str(api)
    if "{}" not in form:
        return form
    return form.format(api.value) if api.has_value else form.replace(" {}", "")


def say(message: BaseException | str) -> str:
    """A message (or an exception's) in the command line's words: each API name as its flag."""
    if isinstance(message, BaseException):
        text = message.args[0] if len(message.args) == 1 else str(message)
        if not isinstance(text, Text):
            return str(message)
        message = text
    return message.say(flag) if isinstance(message, Text) else str(message)
