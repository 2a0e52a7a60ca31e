"""`multigpu doctor --auto`: a model traced (torch.jit.trace, add_graph, torch.export.export) is
said at its line, as --auto's tracing.py changes it."""
from pathlib import Path

from multigpu.doctor.auto_checks import auto_findings

SCRIPT = Path(__file__).resolve().parents[1] / "multiproc/scripts/auto_traced_model.py"
TRACE = ("the model is traced as the script's plain model (its class, its weights at that moment, "
         "without DDP's hooks), as on one device; its gradients are averaged as before")


def test_each_trace_of_the_model_at_its_line():
    found = [f.line() for f in auto_findings(SCRIPT, nproc=2, mode="global", ran=True)
             if f.check == "auto trace"]
    assert found == [f"ok    auto trace     {SCRIPT}:40: torch.jit.trace(model, x0) (and lines 43, "
                     f"44, 46, 52): --auto: {TRACE}"]
