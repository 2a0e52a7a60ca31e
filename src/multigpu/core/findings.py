"""A finding of `multigpu doctor`, and the report it prints: one line per check."""
from __future__ import annotations

import sys
from dataclasses import dataclass

LEVELS = ("ok", "warn", "fail")


@dataclass(frozen=True)
class Finding:
    """One check's result. `message` is one line; for warn and fail it names the cause and the
    fix. `trap` is the trap's number in docs/traps.md; `where` a place in the user's files
    ("train.py:14"), when the finding comes from one."""
    level: str
    check: str
    message: str
    trap: int | None = None
    where: str | None = None

    def __post_init__(self):
        if self.level not in LEVELS:
            raise ValueError(f"level {self.level!r} is not one of {LEVELS}")

    def line(self) -> str:
        place = f"{self.where}: " if self.where else ""
        trap = f" (trap {self.trap})" if self.trap else ""
        return f"{self.level:<4}  {self.check:<14} {place}{self.message}{trap}"


def report(findings: list[Finding], file=None) -> int:
    """Print one line per finding; the exit code: 1 when one of them failed, else 0."""
    out = file or sys.stdout
    for f in findings:
        print(f.line(), file=out, flush=True)
    fails = sum(f.level == "fail" for f in findings)
    warns = sum(f.level == "warn" for f in findings)
    print(f"{len(findings)} checks: {fails} failed, {warns} warnings", file=out, flush=True)
    return 1 if fails else 0


def warn_all(findings: list[Finding]) -> None:
    """How `multigpu run` and `multigpu train` show the warn and fail findings they fire
    themselves: a `multigpu: warning:` line each, on stderr."""
    for f in findings:
        if f.level != "ok":
            place = f"{f.where}: " if f.where else ""
            print(f"multigpu: warning: {place}{f.message}", file=sys.stderr, flush=True)
