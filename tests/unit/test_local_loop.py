"""The launcher's own loop for the ranks of one machine (launcher/local_loop.py), with tiny child
commands: exit codes, the rank that failed first, restarts, stop signals, session leftovers."""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from multigpu.launcher import local_loop, sessions
from multigpu.launcher.rank import stop_reason
from multigpu.launcher.local_loop import LoopSpec


def spec(tmp_path: Path, script: str, nproc: int = 2, **kw) -> LoopSpec:
    """`sh -c script` on `nproc` ranks, every rank's output in files under tmp_path."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    logs = DefaultLogsSpecs(log_dir=str(tmp_path), redirects=Std.ALL)
    return LoopSpec(cmd=["sh", "-c", script], nproc=nproc, run_id="t", logs=logs, **kw)


def signal_me(*at: float, sig=signal.SIGTERM) -> None:
    """`sig` to this process (the launcher) at each of the times `at` (s from now)."""
    for t in at:
        threading.Timer(t, os.kill, (os.getpid(), sig)).start()


def attempts(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob("t_*/attempt_*"))


def test_ranks_that_all_exit_0_end_the_launch_with_no_failure(tmp_path):
    result = local_loop.run(spec(tmp_path, "echo hi $RANK"))
    assert result.failures == {} and result.exit_codes == {0: 0, 1: 0} and result.stop.signals == 0
    assert (next(tmp_path.glob("t_*/attempt_0/1/stdout.log"))).read_text() == "hi 1\n"


def test_the_rank_that_failed_first_is_named_first_and_the_others_are_stopped(tmp_path):
    began = time.monotonic()
    result = local_loop.run(spec(tmp_path, 'if [ "$RANK" = 1 ]; then exit 3; fi; sleep 30'))
    assert time.monotonic() - began < 10  # not the sleep: rank 0 got SIGTERM
    assert [(r, f.exitcode) for r, f in result.failures.items()] == [(1, 3), (0, -signal.SIGTERM)]
    # rank 0 could read why it was stopped, before its SIGTERM
    assert (next(tmp_path.glob("t_*/attempt_0")) / stop_reason.FILE).read_text() == \
        "local rank 1 exited with code 3\n"


def test_each_rank_gets_torch_s_worker_environment_and_a_session_of_its_own(tmp_path):
    script = (f'exec {sys.executable} -c "import json, os; json.dump(dict(os.environ, SID=str(os.getsid(0)), '
              f'PID=str(os.getpid())), open(\'{tmp_path}/env\' + os.environ[\'RANK\'], \'w\'))"')
    ports = []
    store_of = local_loop.local_rendezvous.ranks_store

    def ranks_store():
        store, port = store_of()
        ports.append(port)
        return store, port
    assert local_loop.run(spec(tmp_path, script, nproc=3, ranks_store=ranks_store)).failures == {}
    env = [json.loads((tmp_path / f"env{r}").read_text()) for r in range(3)]
    for r, e in enumerate(env):
        assert {k: e[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                                  "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                                  "TORCHELASTIC_USE_AGENT_STORE")} == {
            "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1", "ROLE_RANK": str(r), "ROLE_WORLD_SIZE": "3",
            "ROLE_NAME": "default", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(ports[0]),
            "TORCHELASTIC_RUN_ID": "t", "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}
        assert Path(e["TORCHELASTIC_ERROR_FILE"]).relative_to(tmp_path).parts[1:] == \
            ("attempt_0", str(r), "error.json")
        assert e["SID"] == e["PID"]  # the rank leads a session of its own


def test_max_restarts_starts_every_rank_again_with_the_next_count_and_says_so(tmp_path, capfd):
    result = local_loop.run(spec(tmp_path, '[ "$TORCHELASTIC_RESTART_COUNT" = 2 ] && exit 0; '
                                           '[ "$RANK" = 0 ] && exit 5; sleep 30', max_restarts=2))
    assert result.failures == {} and attempts(tmp_path) == ["attempt_0", "attempt_1", "attempt_2"]
    said = [line for line in capfd.readouterr().err.splitlines() if "restarting" in line]
    assert len(said) == 2 and said[0].startswith("multigpu: warning: rank 0 (pid ")
    assert said[0].endswith("exited with code 5; restarting all workers (restart 1 of 2)")
    assert said[1].endswith("(restart 2 of 2)")


def test_no_restart_is_left_after_the_last_failure(tmp_path):
    result = local_loop.run(spec(tmp_path, '[ "$RANK" = 1 ] && exit 4; sleep 30', max_restarts=1))
    assert [(r, f.exitcode) for r, f in result.failures.items()] == [(1, 4), (0, -signal.SIGTERM)]
    assert attempts(tmp_path) == ["attempt_0", "attempt_1"]


def test_ranks_that_stop_together_on_a_signal_are_not_restarted(tmp_path):
    # each rank ends as a rank of multigpu train that saved on SIGTERM: 128 + 15
    result = local_loop.run(spec(tmp_path, 'sleep 0.$RANK; exit 143', max_restarts=2,
                                 ranks_stop_together=True))
    assert stop_reason.each_stopped_by_itself(result.exit_codes) == 143
    assert attempts(tmp_path) == ["attempt_0"]
    assert not (tmp_path / next(tmp_path.glob("t_*")) / "attempt_0" / stop_reason.FILE).exists()


def test_a_stop_signal_is_passed_on_to_every_rank(tmp_path):
    signal_me(1.0)
    result = local_loop.run(spec(tmp_path, "trap 'exit 7' TERM; sleep 30 & wait"))
    assert result.stop.signals == 1 and result.stop.sig == signal.SIGTERM
    assert result.exit_codes == {0: 7, 1: 7}


def test_the_first_signal_waits_for_the_ranks_then_kills_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "2")
    signal_me(1.0)
    began = time.monotonic()
    result = local_loop.run(spec(tmp_path, "trap '' TERM; sleep 30"))
    assert 2.5 < time.monotonic() - began < 8
    assert result.exit_codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}
    assert result.stop.waited_out(2)


def test_a_second_signal_kills_the_ranks_at_once(tmp_path):
    signal_me(1.0, 1.5)
    began = time.monotonic()
    result = local_loop.run(spec(tmp_path, "trap '' TERM; sleep 30"))  # the agent's wait: 30 s
    assert time.monotonic() - began < 6
    assert result.stop.signals == 2 and result.exit_codes == {0: -signal.SIGKILL, 1: -signal.SIGKILL}


def test_what_a_rank_killed_by_sigkill_left_in_its_session_is_killed(tmp_path):
    """A rank that starts a child in a process group of its own (as loader workers do), then dies
    by kill -9: the child lives on in the rank's session until the launcher ends it."""
    child = (f"{sys.executable} -c \"import subprocess, sys; p = subprocess.Popen(['sleep', '300'], "
             f"process_group=0); open('{tmp_path}/child' + sys.argv[1], 'w').write(str(p.pid))\" $RANK")
    # rank 1 dies once rank 0's child is there too
    wait = f'while [ ! -f {tmp_path}/child0 ]; do sleep 0.05; done'
    result = local_loop.run(spec(tmp_path, f'{child}; [ "$RANK" = 1 ] && {wait} && kill -9 $$; sleep 30'))
    assert [(r, f.exitcode) for r, f in result.failures.items()][0] == (1, -signal.SIGKILL)
    pids = [int((tmp_path / f"child{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_the_stop_wait_is_torch_s_shutdown_timeout(monkeypatch):
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    assert sessions.stop_wait() == 30
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "3")
    assert sessions.stop_wait() == 3


@pytest.mark.parametrize("python", [True, False])
def test_a_rank_s_command_is_torchrun_s(python):
    cmd = local_loop.rank_command(["-m", "pkg.mod", "--rank=${local_rank}"], 3, python)
    assert cmd[-3:] == ["-m", "pkg.mod", "--rank=3"]
    assert cmd[:2] == ([sys.executable, "-u"] if python else ["-m", "pkg.mod"])


# ------------------------------------------------------------------ public torch API only

def _launch_sources() -> dict[str, str]:
    """The code a launch runs: the loop's modules, the nodes' rendezvous, and launch.launch's part."""
    import inspect
    import textwrap

    from multigpu.launcher import launch, launch_common, local_rendezvous, node_rendezvous, ports

    sources = {m.__name__: inspect.getsource(m) for m in (
        local_loop, local_rendezvous, node_rendezvous, ports, sessions, launch_common, stop_reason)}
    for fn in (launch._launch_here, launch._loop_spec, launch._named_port_held, launch._nodes,
               launch._launcher_failed, launch._said):
        sources[f"launch.{fn.__name__}"] = textwrap.dedent(inspect.getsource(fn))
    return sources


def _private_torch_uses(source: str) -> list[str]:
    """Private torch names a source uses or torch attributes it sets: imports of torch._x or of
    _x from torch, `._x` on a name bound to torch, an assignment to an attribute of one."""
    import ast

    tree, torch_names, found = ast.parse(source), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    torch_names.add((a.asname or a.name).split(".")[0])
                    found += [a.name] if any(p.startswith("_") for p in a.name.split(".")) else []
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            torch_names |= {a.asname or a.name for a in node.names}
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            found += [node.module] if any(p.startswith("_") for p in node.module.split(".")) else []

    def root(node):
        while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return node.id if isinstance(node, ast.Name) else None
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and root(node) in torch_names:
            if node.attr.startswith("_"):
                found.append(f"{root(node)}...{node.attr}")
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                found.append(f"{root(node)}...{node.attr} set")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" \
                and node.args and root(node.args[0]) in torch_names:
            found.append(f"setattr({root(node.args[0])}, ...)")
    return found


def test_the_private_torch_check_finds_a_patch_of_torch():
    patch = ("from torch.distributed.elastic.multiprocessing import api\n"
             "api._terminate_process_handler = print\n")
    assert _private_torch_uses(patch)  # api._terminate_process_handler set


def test_a_launch_uses_no_private_torch_name_nor_patches_torch():
    for name, source in _launch_sources().items():
        assert _private_torch_uses(source) == [], name
        assert "torch._" not in source and "._private" not in source, name
        # nor does it bring back torchrun's agent, which multigpu's rules once had to patch
        used = _names_used(source)
        for agent in ("agent_hooks", "agent_launch", "elastic_launch", "LocalElasticAgent"):
            assert agent not in used, (name, agent)


def _names_used(source: str) -> set[str]:
    """The names, attributes and modules a source imports or uses (not its words)."""
    import ast

    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            used |= {part for a in node.names for part in a.name.split(".")}
            used |= set((getattr(node, "module", None) or "").split("."))
    return used


@pytest.mark.parametrize("tee, redirected", [(False, {1, 2}), (True, {1, 2}), (False, None), (False, set())])
def test_the_ranks_logs_are_laid_out_as_torch_s_default_logs_specs(tmp_path, tee, redirected):
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

    from multigpu.launcher.local_rendezvous import Attempt, rank_environment
    from multigpu.launcher.rank_logs import RankLogs

    redirects = Std.ALL if redirected is None else {r: Std.ALL for r in redirected}
    theirs = DefaultLogsSpecs(log_dir=str(tmp_path / "t"), redirects=redirects,
                              tee=Std.ALL if tee else Std.NONE)
    ours = RankLogs(str(tmp_path / "o"), redirected=redirected, tee=tee)

    def layout(logs, root):
        seen = []
        for number in (0, 1, 1):  # a restart, and the same attempt number again
            envs = {r: rank_environment(r, Attempt("run", 3, number, 1, 1234)) for r in range(3)}
            dest = logs.reify(envs)
            rel = {k: {r: (str(Path(p).relative_to(root).parts[1:]) if p else p) for r, p in v.items()}
                   for k, v in vars(dest).items() if isinstance(v, dict)}
            seen.append((rel, [Path(e["TORCHELASTIC_ERROR_FILE"]).relative_to(root).parts[1:]
                               for e in envs.values()]))
        return seen, sorted(str(p.relative_to(root).parts[1:]) for p in root.rglob("*"))
    assert layout(ours, tmp_path / "o") == layout(theirs, tmp_path / "t")
    assert [p.name.split("_")[0] for p in (tmp_path / "o").iterdir()] == ["run"]
