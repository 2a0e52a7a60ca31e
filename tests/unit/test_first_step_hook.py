"""The training loop's first-step hook (trainloop._stop_gracefully_once_trained): a global
optimizer-step hook that must not disturb torch's loop over the global hooks, nor outlive its run."""
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from multigpu.train import trainloop
from multigpu.train.rundir.timeline import Timeline
from multigpu.core.system import orphans


class _Control:
    def request_stop(self, why):
        pass


def test_a_hook_registered_after_it_still_runs_and_the_run_removes_it(monkeypatch):
    handlers = []
    monkeypatch.setattr(orphans, "on_orphan", handlers.append)
    clock = Timeline()
    handle = trainloop._stop_gracefully_once_trained(_Control(), clock)
    later = []
    other = register_optimizer_step_post_hook(lambda *_: later.append(1))
    try:
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        for _ in range(3):
            p.grad = torch.ones(2)
            opt.step()  # once raised "OrderedDict mutated during iteration" at the first step
        assert len(handlers) == 1 and later == [1, 1, 1]
        assert clock.first_step is not None  # the time: line's first step
    finally:
        other.remove()
        handle.remove()
    p.grad = torch.ones(2)
    opt.step()
    assert len(handlers) == 1  # removed: a later run in this process starts with its own
