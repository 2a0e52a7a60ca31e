"""DataParallel's replica threads, on CPU: the CUDA device and stream contexts are stubbed out, the
rest (threads, state handed over, errors) is the real code. tests/gpu runs it on GPUs."""
import contextlib
import gc
import threading
import weakref

import pytest
import torch
from torch import nn

from multigpu.core.strategies import replica_threads


@pytest.fixture(autouse=True)
def no_cuda_contexts(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


class Probe(nn.Module):
    def __init__(self, log, fail=False):
        super().__init__()
        self.log, self.fail, self.last = log, fail, None

    def forward(self, x):
        big = torch.ones(1000)  # stands in for the activations of a failing forward
        self.last = weakref.ref(big)
        if self.fail:
            raise ValueError("replica failure")
        self.log.append((threading.current_thread().name, torch.is_grad_enabled()))
        return x * 2


def test_each_device_keeps_its_thread_and_the_callers_grad_mode():
    log = []
    replicas = [Probe(log), Probe(log)]
    for _ in range(3):
        out = replica_threads.parallel_apply(replicas, [torch.ones(1), torch.ones(1) * 3],
                                             None, [0, 1])
    assert [o.item() for o in out] == [2.0, 6.0]
    names = {name for name, _ in log}
    assert len(names) == 2 and threading.current_thread().name not in names
    assert replica_threads.worker_threads().keys() >= {0, 1}
    with torch.no_grad():
        replica_threads.parallel_apply(replicas, [torch.ones(1)] * 2, None, [0, 1])
    assert [grad for _, grad in log[-2:]] == [False, False] and log[0][1] is True


def test_a_replica_error_names_it_and_frees_its_tensors_at_once():
    log = []
    replicas = [Probe(log), Probe(log, fail=True)]
    gc.disable()  # the failed forward's tensors must go with the exception, not at a gc pass
    try:
        with pytest.raises(ValueError, match="replica failure") as caught:
            replica_threads.parallel_apply(replicas, [torch.ones(1)] * 2, None, [0, 1])
        assert "(in DataParallel replica 1, on cuda:1)" in caught.value.__notes__
        assert len(log) == 1, "the other replica ran to its end"
        del caught
        assert replicas[1].last() is None, "a reference cycle kept the failed forward alive"
    finally:
        gc.enable()
    out = replica_threads.parallel_apply(replicas[:1], [torch.ones(1)], None, [0])
    assert out[0].item() == 2.0, "the threads survive a failed step"
