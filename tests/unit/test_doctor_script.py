"""multigpu doctor's script checks: the posts' own code read for the traps it shows."""
import textwrap

from multigpu.doctor.script_checks import script_findings
from multigpu.doctor.shell_checks import file_crlf_finding


def scan(tmp_path, source, *, name="train.py", nproc=4, gpus=True):
    """The findings for `source` (dedented; line 1 is its first line), and the file's path."""
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path, script_findings(path, nproc=nproc, gpus=gpus)


def of(findings, check):
    return [f for f in findings if f.check == check]


def test_post_002_sets_the_launch_variables_itself(tmp_path):
    path, found = scan(tmp_path, """\
        import os
        os.environ['CUDA_LAUNCH_BLOCKING'] = '1'
        os.environ["WORLD_SIZE"] = '4'
        os.environ['MASTER_ADDR'] = '127.0.0.1'
        os.environ['MASTER_PORT'] = '29500'
        os.environ.setdefault('RANK', '0')
        os.environ['LOCAL_RANK'] = os.environ.get('LOCAL_RANK', '0')
        os.environ['CUDA_VISIBLE_DEVICES'] = "4,5,2,8"
        """)
    env = of(found, "launch env")
    assert [(f.level, f.where, f.trap) for f in env] == [
        ("fail", f"{path}:3", 8), ("warn", f"{path}:4", 8), ("fail", f"{path}:5", 8),
        ("warn", f"{path}:8", 13)]
    assert env[2].message.startswith("sets MASTER_PORT='29500': multigpu run hosts the rendezvous")
    assert "delete the line, or launch with --master-port 29500" in env[2].message
    assert "never meet (a hang): delete the line" in env[0].message
    assert "overriding the GPUs multigpu run chose" in env[3].message and "--devices" in env[3].message


def test_environ_update_putenv_and_a_hard_coded_rendezvous_are_found(tmp_path):
    path, found = scan(tmp_path, """\
        import os
        import torch.distributed as dist
        os.environ.update({"MASTER_ADDR": "localhost"}, RANK="0")
        os.putenv("MASTER_PORT", "12355")
        dist.init_process_group("nccl", init_method="tcp://10.1.1.20:23456", rank=0, world_size=4)
        dist.init_process_group("nccl", init_method="env://")
        """)
    assert [f.where for f in of(found, "launch env")] == [f"{path}:3"] * 2 + [f"{path}:4", f"{path}:5"]
    rendezvous = of(found, "launch env")[-1].message
    assert "init_method='tcp://10.1.1.20:23456', world_size=4, rank=0" in rendezvous
    assert "fix: init_process_group(backend)" in rendezvous and "multigpu.setup()" in rendezvous


def test_post_000_dataparallel_before_the_model_is_on_the_gpu(tmp_path):
    path, found = scan(tmp_path, """\
        import torch
        from torch import nn
        from torchvision import models
        ids = [0, 1, 2, 3]
        model = models.vgg16()
        model.load_state_dict(torch.load("vgg16.pth"))
        model = nn.DataParallel(model, device_ids=ids)
        """)
    replicas, cpu = of(found, "dataparallel")
    assert (replicas.level, replicas.trap, replicas.where) == ("fail", 5, f"{path}:7")
    assert "each of the 4 processes would replicate the model" in replicas.message
    assert "rt.prepare(model)" in replicas.message and "python train.py" in replicas.message
    assert (cpu.level, cpu.trap, cpu.where) == ("fail", 1, f"{path}:7")
    assert "parameters on cuda:0" in cpu.message and "model.to('cuda'), then wrap" in cpu.message


def test_dataparallel_then_cuda_in_one_process_is_only_slower_than_ddp(tmp_path):
    path, found = scan(tmp_path, """\
        import torch
        model = Net()
        model = torch.nn.DataParallel(model, device_ids=[0, 3]).cuda()
        out = model(x)
        torch.save(model.module.state_dict(), "m.pt")
        """, nproc=1)
    [f] = found
    assert (f.level, f.check, f.trap, f.where) == ("warn", "dataparallel", 5, f"{path}:3")
    assert "slower than DDP" in f.message and "multigpu run --devices N" in f.message


def test_a_model_moved_anywhere_or_built_by_a_function_of_the_script_is_not_trap_1(tmp_path):
    _, found = scan(tmp_path, """\
        from torch.nn import DataParallel
        def build():
            return Net().cuda()
        net = Net()
        net.to("cuda:0")
        a = DataParallel(net)
        b = DataParallel(build())
        c = DataParallel(Net().to(device))
        """, nproc=1)
    assert [f.trap for f in of(found, "dataparallel")] == [5, 5, 5]


def test_dataparallel_in_cpu_processes_trains_unsynced_copies(tmp_path):
    _, found = scan(tmp_path, "import torch\nmodel = torch.nn.DataParallel(Net())\n", gpus=False)
    [f] = of(found, "dataparallel")  # no trap 1: nothing moves to a GPU on CPU devices
    assert f.level == "fail" and "the 4 CPU processes would train 4 unsynced models" in f.message


def test_post_003_custom_method_and_module_call_bypass_the_scatter(tmp_path):
    path, found = scan(tmp_path, """\
        from torch import nn
        model = nn.DataParallel(model.cuda())
        y = model(x)
        y = model.my_forward_method(x)
        y = model.module(x)
        y = model.module.encode(x)
        model.eval()
        model.module.load_state_dict(sd)
        y = model.forward(x)
        """, nproc=1)
    scatter = of(found, "scatter")
    assert [(f.level, f.trap, f.where) for f in scatter] == [
        ("warn", 10, f"{path}:{n}") for n in (4, 5, 6, 9)]
    assert "fix: call model(x) and call my_forward_method(...) from forward" in scatter[0].message
    assert "the whole batch runs on one GPU; fix: call model(x)" in scatter[1].message
    assert scatter[2].message.startswith("model.module.encode(...) goes around DataParallel's forward")


def test_a_ddp_model_called_around_its_forward_unless_under_no_grad(tmp_path):
    path, found = scan(tmp_path, """\
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = DDP(net.to(device), device_ids=[local_rank])
        with net.no_sync():
            loss = net.module(x).sum()
        with torch.no_grad():
            val = net.module(x)
        feats = net.extract(x)
        """, nproc=2)
    scatter = of(found, "scatter")
    assert [f.where for f in scatter] == [f"{path}:4", f"{path}:7"]
    assert "DDP does not ready the gradient all-reduce" in scatter[0].message
    assert "is not a DDP method" in scatter[1].message


def test_post_004_saves_the_wrapped_state_dict(tmp_path):
    path, found = scan(tmp_path, """\
        import torch
        net = torch.nn.Linear(10, 1).cuda()
        torch.save(net.state_dict(), "./plain.pt")
        net = torch.nn.DataParallel(net)
        torch.save(net.state_dict(), "./8.4_model.pt")
        torch.save({"model": net.state_dict(), "epoch": 3}, "./ckpt.pt")
        torch.save(net.module.state_dict(), "./8.4_model.pt")
        """, nproc=1)
    saves = of(found, "checkpoint")
    assert [(f.level, f.trap, f.where) for f in saves] == [
        ("warn", 12, f"{path}:5"), ("warn", 12, f"{path}:6")]
    assert "'module.' prefix" in saves[0].message
    assert "torch.save(net.module.state_dict(), ...)" in saves[0].message


def test_a_distributed_sampler_never_reshuffled_and_a_padded_validation(tmp_path):
    source = """\
        from torch.utils.data.distributed import DistributedSampler
        train_sampler = DistributedSampler(train_set)
        val_sampler = DistributedSampler(val_set, shuffle=False)
        """
    path, found = scan(tmp_path, source, nproc=4)
    epochs, padded = of(found, "sampler")
    assert (epochs.level, epochs.where) == ("warn", f"{path}:2")
    assert "sampler.set_epoch(epoch)" in epochs.message
    assert (padded.level, padded.where, padded.trap) == ("warn", f"{path}:3", 3)
    assert "counts up to 3 samples twice" in padded.message and "rank 0 only" in padded.message
    assert "rt.prepare(val_loader)" in padded.message
    assert of(scan(tmp_path, source, nproc=1)[1], "sampler") == []


def test_a_clean_ddp_script_has_no_known_trap(tmp_path):
    _, found = scan(tmp_path, """\
        import os
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler
        local_rank = int(os.environ["LOCAL_RANK"])
        os.environ.setdefault("MASTER_PORT", "29500")
        dist.init_process_group("nccl")
        model = DDP(Net().to(local_rank), device_ids=[local_rank])
        sampler = DistributedSampler(dataset)
        loader = DataLoader(dataset, batch_size=32, sampler=sampler)
        for epoch in range(10):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = loss_fn(model(x), y)
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), "model.pt")
        """)
    assert [(f.level, f.check, f.message) for f in found] == [("ok", "script", "no known trap in the source")]


def test_fp16_autocast_without_a_gradscaler(tmp_path):
    path, found = scan(tmp_path, """\
        import torch
        from torch.cuda.amp import autocast
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        with torch.autocast("cpu"):
            out = model(x)
        with autocast():
            out = model(x)
        """)
    [f] = of(found, "precision")
    assert (f.level, f.where, f.trap) == ("warn", f"{path}:7", 7)
    assert "underflow to zero" in f.message and "scaler = torch.amp.GradScaler()" in f.message


def test_autocast_cuda_defaults_to_fp16_and_a_gradscaler_silences_it(tmp_path):
    path, found = scan(tmp_path, "import torch\nwith torch.autocast(device_type='cuda'):\n    y = m(x)\n")
    assert [f.where for f in of(found, "precision")] == [f"{path}:2"]
    path, found = scan(tmp_path, "import torch\nwith torch.autocast(dev.type):\n    y = m(x)\n"
                                 "with torch.autocast(dev.type, torch.float16):\n    y = m(x)\n")
    assert [f.where for f in of(found, "precision")] == [f"{path}:4"]
    _, found = scan(tmp_path, "import torch\nscaler = torch.amp.GradScaler()\nwith torch.autocast('cuda'):\n"
                              "    y = m(x)\nmodel.half()\nmodel.train()\n")
    assert of(found, "precision") == []


def test_a_half_model_and_apex(tmp_path):
    path, found = scan(tmp_path, """\
        from apex import amp
        model = Net().cuda()
        model.half()
        x = x.half()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        """)
    apex, half = of(found, "precision")
    assert (apex.level, apex.where, apex.trap) == ("warn", f"{path}:1", 7) and "torch.amp" in apex.message
    assert (half.where, half.trap) == (f"{path}:3", 7) and "pure fp16" in half.message


def test_local_rank_flag_is_passed_and_the_environment_needs_nothing(tmp_path):
    path, found = scan(tmp_path, """\
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--local_rank", type=int, default=0)
        """)
    [f] = found
    assert (f.level, f.check, f.where, f.trap) == ("ok", "local rank", f"{path}:3", 15)
    assert "multigpu run passes --local_rank=<local rank>" in f.message
    _, found = scan(tmp_path, "p.add_argument('--local-rank', type=int)\n")
    assert "passes --local-rank=<local rank>" in found[0].message
    _, found = scan(tmp_path, "import os\nlocal_rank = int(os.environ['LOCAL_RANK'])\n")
    assert [f.check for f in found] == ["script"]


def test_accelerate_and_lightning_scripts_are_noted(tmp_path):
    path, found = scan(tmp_path, "from accelerate import Accelerator\nimport lightning.fabric as L\n"
                                 "import pytorch_lightning as pl\n")
    assert [(f.level, f.check, f.where) for f in found] == [
        ("ok", "launcher", f"{path}:{n}") for n in (1, 2, 3)]
    assert found[0].message.startswith("an Accelerate script: multigpu run starts one process per device")


def test_post_002_run_sh_with_crlf_and_torch_distributed_launch(tmp_path):
    path = tmp_path / "run.sh"
    lines = ["milan=1", "CUDA_VISIBLE_DEVICES=0,1 python3 -m torch.distributed.launch --nproc_per_node=4 "
             "--master_port 29999 trainModel_distr_gpus.py \\", "    -set_num $milan", "wait", ""]
    path.write_bytes("\r\n".join(lines).encode())
    crlf, launch, cvd = script_findings(path, nproc=4, gpus=True)
    assert (crlf.level, crlf.check, crlf.where, crlf.trap) == ("fail", "shell", f"{path}:1", 9)
    assert f"sed -i 's/\\r$//' {path}" in crlf.message
    assert (launch.level, launch.where, launch.trap) == ("warn", f"{path}:2", 15)
    assert "fix: multigpu run --devices 4 trainModel_distr_gpus.py ..." in launch.message
    assert (cvd.level, cvd.where) == ("ok", f"{path}:2") and "--devices 0,1" in cvd.message
    assert file_crlf_finding(path) == crlf


def test_file_crlf_only_matters_for_shell_scripts(tmp_path):
    for name, data, expected in [("job.sh", b"echo hi\n", None), ("cfg.yaml", b"lr: 0.1\r\n", None),
                                 ("t.py", b"x = 1\r\n", None), ("job", b"echo hi\r\n", "fail"),
                                 ("t", b"#!/bin/bash\r\necho\r\n", "fail"),
                                 ("tool", b"#!/usr/bin/env python3\r\nx = 1\r\n", None)]:
        (tmp_path / name).write_bytes(data)
        f = file_crlf_finding(tmp_path / name)
        assert (f and f.level) == expected, name


def test_a_python_shebang_is_python_and_a_syntax_error_names_its_line(tmp_path):
    path, found = scan(tmp_path, "#!/usr/bin/env python3\nimport os\nprint 'epoch', 1\n", name="train")
    [f] = found
    assert (f.level, f.check, f.where) == ("fail", "syntax", f"{path}:3")
    assert "Python cannot parse it" in f.message and "all 4 processes" in f.message


def test_every_message_is_one_line_and_findings_are_sorted_by_line(tmp_path):
    _, found = scan(tmp_path, """\
        import torch, os
        from apex import amp
        model = torch.nn.DataParallel(Net())
        torch.save(model.state_dict(), "m.pt")
        os.environ["MASTER_PORT"] = "1234"
        """)
    lines = [int(f.where.rsplit(":", 1)[1]) for f in found]
    assert lines == sorted(lines) and lines[0] == 2 and len(found) == 5
    assert all("\n" not in f.message for f in found)


def test_a_literal_passed_to_a_dataparallel_model_is_named_as_not_split(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import torch\nfrom torch import nn\n"
                    "model = nn.DataParallel(Net().cuda())\n"
                    "out = model(x, [3, 5, 2, 7], mode='train')\n"
                    "out = model(x, lengths)\n")
    found = [f for f in script_findings(path, nproc=1, gpus=True) if f.trap == 11]
    assert len(found) == 1
    f = found[0]
    assert f.level == "warn" and f.where == f"{path}:4" and f.check == "scatter"
    assert "[3, 5, 2, 7] passed to model (DataParallel) is copied whole to every GPU" in f.message
    assert "as a tensor with the batch dimension first" in f.message


def test_a_script_that_spawns_its_own_processes_fails_under_a_launch_of_several(tmp_path):
    path = tmp_path / "multigpu_tutorial.py"  # pytorch/examples' DDP tutorial, in short
    path.write_text("import torch\nimport torch.multiprocessing as mp\n\n"
                    "def main(rank, world_size):\n    pass\n\n"
                    "if __name__ == '__main__':\n"
                    "    world_size = torch.cuda.device_count()\n"
                    "    mp.spawn(main, args=(world_size,), nprocs=world_size)\n")
    [f] = [f for f in script_findings(path, nproc=4, gpus=True) if "spawn" in f.message]
    assert f.level == "fail" and f.where == f"{path}:9" and f.trap == 8
    assert "mp.spawn(...) starts processes of its own: under multigpu run each of the 4 processes" in f.message
    [one] = [f for f in script_findings(path, nproc=1, gpus=True) if "spawn" in f.message]
    assert one.level == "warn"


def test_scripts_that_guard_their_own_launch_or_use_the_bare_model_on_purpose_are_not_flagged(tmp_path):
    path, found = scan(tmp_path, """\
        import os
        import torch.multiprocessing as mp
        from torch.nn.parallel import DistributedDataParallel as DDP
        if "RANK" not in os.environ:
            os.environ["MASTER_ADDR"] = "localhost"
            os.environ["MASTER_PORT"] = "29500"
        net = DDP(net.to(device))
        text = net.module.generate(ids)
        net.module.save_pretrained("out")
        if "LOCAL_RANK" in os.environ:
            main()
        else:
            mp.spawn(main, nprocs=4)
        """, nproc=2)
    assert [f.check for f in found] == ["script"], [f.line() for f in found]


def test_flags_and_tensor_containers_passed_to_dataparallel_are_not_called_unsplit(tmp_path):
    path, found = scan(tmp_path, """\
        from torch import nn
        model = nn.DataParallel(Net().cuda())
        out = model(x, True, mode="train")
        out = model(x, (h, c), {"mask": m})
        """, nproc=1)
    assert not [f for f in found if f.trap == 11]


def test_the_port_the_launch_was_given_is_not_a_finding(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("import os\nos.environ['MASTER_PORT'] = '29500'\n")
    assert [f.check for f in script_findings(path, nproc=2, gpus=False, master_port=29500)] == ["script"]


ONE_DEVICE = """\
    import torch
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(8, 4)).sum()
    loss.backward()
    optimizer.step()
    """


def test_a_one_device_training_script_started_n_times_is_said_with_auto_as_the_fix(tmp_path):
    """multigpu run trained N independent full copies of it, each writing the same files,
    without a word."""
    path, found = scan(tmp_path, ONE_DEVICE, nproc=2)
    assert [f.line() for f in of(found, "process group")] == [
        "warn  process group  train.py forms no process group (no torch.distributed."
        "init_process_group): each of the 2 processes runs the whole script alone, 2 independent "
        "full trainings that each write the same files; run it with --auto to make it "
        f"data-parallel unmodified (multigpu run --auto {path})"]
    assert not of(scan(tmp_path, ONE_DEVICE, nproc=1)[1], "process group"), "1 process: alone"
    for distributed in ("import torch.distributed as dist\n", "from accelerate import Accelerator\n",
                        "import multigpu\n", "rank = int(os.environ['LOCAL_RANK'])\n",
                        "from utils import init_distributed_mode\n"):
        _, found = scan(tmp_path, distributed + textwrap.dedent(ONE_DEVICE), nproc=2)
        assert not of(found, "process group"), distributed
    _, found = scan(tmp_path, "import torch\nprint(torch.randn(2))\n", nproc=2)
    assert not of(found, "process group"), "no training shown: silent"
