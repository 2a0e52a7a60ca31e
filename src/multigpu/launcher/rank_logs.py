"""Where the ranks of one machine write (local_loop), laid out as torch's DefaultLogsSpecs lays
them out, without torch: the launcher starts its ranks before it imports torch (its store comes
up while they import theirs, local_rendezvous).

    <log dir>/<run id>_<random>/attempt_<n>/<local rank>/{stdout,stderr}.log and error.json

The run's folder is made at the first attempt (tempfile.mkdtemp, as torch's), each attempt's
folder afresh; TORCHELASTIC_ERROR_FILE is put in each rank's environment. `redirected`: the
local ranks whose stdout and stderr go to files (the others: this console, ""); `tee`: every
rank's files also shown here (local_loop's --tee tails, which read tee_stdouts/tee_stderrs).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field


@dataclass
class RankLogsDest:
    """The files of one attempt, by local rank ("": the console), as torch's LogsDest."""
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)


class RankLogs:
    """One launch's logs (one per launch, as torch's DefaultLogsSpecs): `reify` for each attempt."""

    def __init__(self, log_dir: str, redirected: set[int] | None = None, tee: bool = False):
        if os.path.isfile(log_dir):
            raise NotADirectoryError(f"log_dir: {log_dir} is a file")
        os.makedirs(log_dir, exist_ok=True)
        self.root_log_dir = str(log_dir)
        self._redirected, self._tee = redirected, tee
        self._run_log_dir: str | None = None

    def _to_files(self, local_rank: int) -> bool:
        return self._tee or self._redirected is None or local_rank in self._redirected

    def reify(self, envs: dict[int, dict[str, str]]) -> RankLogsDest:
        """The attempt's folders made (an earlier one of the same number removed) for the ranks
        of `envs` (rank_environment's), their TORCHELASTIC_ERROR_FILE set there."""
        run_id = envs[0]["TORCHELASTIC_RUN_ID"] if envs else "test_run_id"
        attempt = envs[0]["TORCHELASTIC_RESTART_COUNT"] if envs else "0"
        if self._run_log_dir is None:
            os.makedirs(self.root_log_dir, exist_ok=True)
            self._run_log_dir = tempfile.mkdtemp(prefix=f"{run_id}_", dir=self.root_log_dir)
        attempt_dir = os.path.join(self._run_log_dir, f"attempt_{attempt}")
        shutil.rmtree(attempt_dir, ignore_errors=True)
        os.makedirs(attempt_dir)
        dest = RankLogsDest()
        for r in range(len(envs)):
            rank_dir = os.path.join(attempt_dir, str(r))
            os.mkdir(rank_dir)
            files = self._to_files(r)
            dest.stdouts[r] = os.path.join(rank_dir, "stdout.log") if files else ""
            dest.stderrs[r] = os.path.join(rank_dir, "stderr.log") if files else ""
            if self._tee:
                dest.tee_stdouts[r], dest.tee_stderrs[r] = dest.stdouts[r], dest.stderrs[r]
            dest.error_files[r] = os.path.join(rank_dir, "error.json")
            envs[r]["TORCHELASTIC_ERROR_FILE"] = dest.error_files[r]
        return dest
