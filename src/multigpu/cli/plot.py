"""`multigpu plot RUN...`: the training curves of one run or several, on one figure.

One run: the picture goes to RUN/curves.png (the file multigpu train draws at the end of a run;
drawn again here, it shows a run still training as far as it got). Several runs: --out FILE.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from multigpu.core.system import fileio
from multigpu.core.errors import UsageError
from multigpu.train.rundir.runfolder import METRICS

EXAMPLES = """\
examples:
  multigpu plot runs/20261125-101500-cnn-digits
  multigpu plot runs/lr-1e-3 runs/lr-3e-3 --out lr.png
"""


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("plot", help="draw the training curves of runs into a PNG",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (made by multigpu train)")
    p.add_argument("--out", metavar="FILE.png",
                   help="where the picture goes (default for one run: RUN/curves.png; needed for "
                        "several); an existing file other than a run's curves.png is not replaced")
    p.add_argument("--title", help="the figure's title (default: the run names)")
    return p


def main(args: argparse.Namespace) -> int:
    from multigpu.train.rundir import plots

    runs = [Path(r) for r in args.runs]
    for run in runs:
        if not (run / METRICS).is_file():
            why = "does not exist" if not run.exists() else f"holds no {METRICS} (no finished epoch yet?)"
            raise UsageError(f"{run} {why}: give run folders made by multigpu train, e.g. runs/<name>")
    if args.out is None and len(runs) > 1:
        raise UsageError(f"{len(runs)} runs go on one figure: say where with --out, e.g. --out compare.png")
    out = Path(args.out) if args.out else runs[0] / plots.CURVES
    if out.suffix.lower() != ".png":
        raise UsageError(f"--out {out}: the picture is a PNG; give a name ending in .png")
    fileio.check_can_make(out, "--out", file=True)
    ours = out.name == plots.CURVES and (out.parent / METRICS).is_file()
    if out.exists() and not ours:
        raise UsageError(f"--out {out} already exists; multigpu does not replace your files: "
                         "choose another name")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: the folder {out.parent} does not exist")
    plots.draw(runs, out, title=args.title)
    print(out)
    return 0
