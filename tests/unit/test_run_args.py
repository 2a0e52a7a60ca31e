"""`multigpu run SCRIPT ARGS`: the arguments after the script are the script's, whatever they
look like to run's own options."""
from multigpu.cli import build_parser


def test_a_scripts_option_that_starts_like_runs_own_is_the_scripts():
    # nanoGPT's train.py takes --device=cpu: once refused as an ambiguous --devices/--device-health
    args = build_parser().parse_args(["run", "--devices", "cpu:2", "train.py", "--device=cpu",
                                      "--dev", "3", "--min-free", "1"])
    assert args.devices == "cpu:2" and args.min_free_memory == 2.0
    assert [args.target, *args.script_args] == ["train.py", "--device=cpu", "--dev", "3",
                                                "--min-free", "1"]
