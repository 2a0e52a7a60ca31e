"""No command takes an abbreviation of its own options: `multigpu doctor SCRIPT ARGS` and
`multigpu sweep COMMAND ...` take what follows as the script's or the command's, and argparse
checks every argument against the command's option prefixes first (a script's `--step 3` was
refused as an ambiguous --steps / --step-size)."""
import pytest

from multigpu import cli
from multigpu.cli import build_parser


def test_a_scripts_option_that_starts_like_doctors_own_is_the_scripts():
    args = build_parser().parse_args(["doctor", "--devices", "cpu:2", "--steps", "3", "train.py",
                                      "--step", "5", "--device=cpu", "--trial", "x"])
    assert args.devices == "cpu:2" and args.steps == 3 and args.trial_timeout == 300.0
    assert args.script == ["train.py", "--step", "5", "--device=cpu", "--trial", "x"]


def test_a_commands_option_that_starts_like_sweeps_own_is_the_commands():
    args = build_parser().parse_args(["sweep", "--grid", "lr=1,2", "multigpu", "run", "t.py",
                                      "--device=cpu", "--max", "3"])
    assert args.devices is None and args.max_parallel is None
    assert args.rest == ["multigpu", "run", "t.py", "--device=cpu", "--max", "3"]


@pytest.mark.parametrize("argv, said", [
    (["doctor", "--trial-time", "60", "--", "t.py"],
     "multigpu doctor has no option --trial-time; did you mean --trial-timeout?"),
    (["doctor", "--scal", "--model", "mlp"], "multigpu doctor has no option --scal; did you mean --scaling?"),
    (["train", "--model", "mlp", "--epoch", "2"], "multigpu train has no option --epoch; did you mean --epochs?"),
    (["train", "--conf", "run.yaml"], "multigpu train has no option --conf; did you mean --config?"),
    (["sweep", "--dry", "--", "multigpu", "train"], "multigpu sweep has no option --dry; "
                                                    "multigpu sweep --help lists them"),
    (["bench", "--warm", "2"], "multigpu bench has no option --warm; did you mean --warmup?"),
    (["--vers"], "multigpu has no option --vers; did you mean --version?"),
])
def test_an_abbreviated_option_is_one_line_naming_the_full_one(argv, said, capsys):
    try:
        code = cli.main(argv)
    except SystemExit as exc:  # from the parser, as `multigpu` (cli.entry) exits with it
        code = exc.code
    assert code == 2
    assert capsys.readouterr().err == f"multigpu: error: {said}\n"


def test_no_command_takes_abbreviations():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # argparse has no accessor
    assert [name for name, p in commands.items() if p.allow_abbrev] == []
    assert not parser.allow_abbrev
