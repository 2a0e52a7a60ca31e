"""head_start.HeadStart: a worker's imports and folder listing, in a thread while its group forms."""
import json
import subprocess
import sys

import pytest

from multigpu.core.errors import UsageError
from multigpu.train import training
from multigpu.train.settings.config import TrainConfig
from multigpu.train.head_start import HeadStart
from tests.unit.test_datasets import make_image_folder

# A fresh interpreter: one process's start, whether the thread left torch's compiler loaded.
ONE_PROCESS = """
import json, sys
from multigpu.train.settings.config import TrainConfig
from multigpu.train.head_start import HeadStart
before = "torch._dynamo" in sys.modules
HeadStart.begin(TrainConfig.from_flat(model="mlp", data="synthetic:64"), env={}).imports_done()
print(json.dumps({"before": before, "after": "torch._dynamo" in sys.modules}))
"""

# A fresh interpreter (this one has torch._dynamo loaded by other tests): a 2-process DDP run's
# start on folder data, then what the thread did and whether the compiler is loaded after it.
PROBE = """
import json, sys
from multigpu.train.settings.config import TrainConfig
from multigpu.train.head_start import HeadStart
cfg = TrainConfig.from_flat(model="cnn", data="folder:" + sys.argv[1], image_size=8)
parts = []
head = HeadStart.begin(cfg, env={"WORLD_SIZE": "2"}, on_part=lambda *span: parts.append(span))
data = head.data()
head.imports_done()
assert parts == head.spans
print(json.dumps({"parts": [part for part, _, _ in head.spans], "classes": data.train.classes,
                  "samples": len(data.train), "compiler": "torch._dynamo" in sys.modules}))
"""


def said_by(script: str, *args) -> dict:
    """What `script`, run in a fresh interpreter with `args`, printed last (a JSON line)."""
    done = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_ddp_run_on_folder_data_gets_its_decoder_listing_and_compiler_from_the_thread(tmp_path):
    make_image_folder(tmp_path, classes=("cat", "dog"), per_class=3)
    said = said_by(PROBE, tmp_path)
    assert said == {"parts": ["compiler's modules", "decoder", "folder listing", "compiler"],
                    "classes": ["cat", "dog"], "samples": 6, "compiler": True}


# Until the group has formed the thread leaves torch._dynamo alone: init_process_group waits for
# a torch._dynamo being imported (it clears the compiler's caches when it finds it in sys.modules).
BEFORE_THE_GROUP = """
import json, sys, time
from multigpu.train.settings.config import TrainConfig
from multigpu.train.head_start import HeadStart
head = HeadStart.begin(TrainConfig.from_flat(model="mlp", data="synthetic:64"), env={"WORLD_SIZE": "2"})
deadline = time.monotonic() + 120
while not head.spans and time.monotonic() < deadline:
    time.sleep(0.01)
before = [part for part, _, _ in head.spans], "torch._dynamo" in sys.modules, "sympy" in sys.modules
time.sleep(0.5)  # a thread that went on would be importing torch._dynamo by now
still = "torch._dynamo" in sys.modules
head.group_formed()
head.imports_done()
print(json.dumps({"before": before, "still": still, "after": "torch._dynamo" in sys.modules,
                  "parts": [part for part, _, _ in head.spans]}))
"""


def test_the_compiler_itself_is_imported_only_once_the_group_has_formed():
    said = said_by(BEFORE_THE_GROUP)
    assert said == {"before": [["compiler's modules"], False, True], "still": False, "after": True,
                    "parts": ["compiler's modules", "compiler"]}


CANCELLED = """
import json, sys, time
from multigpu.train.settings.config import TrainConfig
from multigpu.train.head_start import HeadStart
head = HeadStart.begin(TrainConfig.from_flat(model="mlp", data="synthetic:64"), env={"WORLD_SIZE": "2"})
deadline = time.monotonic() + 120
while not head.spans and time.monotonic() < deadline:
    time.sleep(0.01)
head.cancel()  # the group's setup failed
head._thread.join(60)
print(json.dumps({"alive": head._thread.is_alive(), "compiler": "torch._dynamo" in sys.modules,
                  "parts": [part for part, _, _ in head.spans]}))
"""


def test_a_run_that_fails_before_its_group_forms_ends_the_thread_without_the_compiler():
    said = said_by(CANCELLED)
    assert said == {"alive": False, "compiler": False, "parts": ["compiler's modules"]}


def test_a_broken_folder_is_said_where_the_run_takes_its_data_with_the_message_read_in_line(tmp_path):
    make_image_folder(tmp_path, classes=("cat",), per_class=2)
    cfg = TrainConfig.from_flat(model="cnn", data=f"folder:{tmp_path}", image_size=8)
    with pytest.raises(UsageError) as in_line:
        training.load_run_data(cfg)
    head = HeadStart.begin(cfg, env={})  # the thread meets the error; begin() does not raise it
    with pytest.raises(UsageError) as from_thread:
        head.data()
    assert str(from_thread.value) == str(in_line.value)
    assert "has one class folder (cat)" in str(in_line.value)


def test_one_process_on_synthetic_data_imports_the_optimizer_s_compiler_ahead_and_the_switch_turns_it_off():
    """Every run makes an optimizer, whose first parameter group imports torch._dynamo: one process
    too has the thread import it (with no group to wait for) while the model is built."""
    cfg = TrainConfig.from_flat(model="mlp", data="synthetic:64")
    head = HeadStart.begin(cfg, env={})
    assert head.data() is None and not head.loads_data
    head.imports_done()
    assert [part for part, *_ in head.spans] == ["compiler's modules", "compiler"]
    assert json.loads(subprocess.run([sys.executable, "-c", ONE_PROCESS], capture_output=True, text=True,
                                     check=True).stdout) == {"before": False, "after": True}
    off = HeadStart.begin(cfg, env={"WORLD_SIZE": "2", "MULTIGPU_HEAD_START": "0"})
    off.imports_done()
    assert (off.data(), off.loads_data, off.spans) == (None, False, [])


# A run that forks its loader workers early holds the thread between two imports: held, it stops
# after the data (here the folder's listing) and imports the compiler only once it is let go.
HELD = """
import json, sys, time
from multigpu.train.settings.config import TrainConfig
from multigpu.train.head_start import HeadStart
cfg = TrainConfig.from_flat(model="cnn", data="folder:" + sys.argv[1], image_size=8)
head = HeadStart.begin(cfg, env={}, hold=True)
data = head.data()
with head.paused():  # where the run forks
    parked = head.parked()
    time.sleep(0.5)  # a thread that went on would be importing torch._dynamo by now
    inside = [part for part, _, _ in head.spans], "torch._dynamo" in sys.modules
head.imports_done()
print(json.dumps({"parked": parked, "inside": inside, "samples": len(data.train),
                  "after": [[part for part, _, _ in head.spans], "torch._dynamo" in sys.modules]}))
"""


def test_a_held_thread_imports_nothing_while_the_run_forks_and_the_compiler_after_it(tmp_path):
    make_image_folder(tmp_path, classes=("cat", "dog"), per_class=3)
    said = said_by(HELD, tmp_path)
    listed = ["compiler's modules", "decoder", "folder listing"]
    assert said == {"parked": True, "inside": [listed, False], "samples": 6,
                    "after": [listed + ["compiler"], True]}
