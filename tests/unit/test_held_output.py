"""held_output (core/system): what this process and its children write meanwhile is held back."""
import subprocess
import sys

from multigpu.core.system.held_output import held_output


def test_output_of_this_process_and_its_children_is_held_and_its_warnings_can_be_kept(capfd):
    print("before", flush=True)
    with held_output() as held:
        print("progress 1")
        print("multigpu: warning: a warning", file=sys.stderr)
        subprocess.run([sys.executable, "-c", "import sys; print('child'); "
                        "print('multigpu: error: a child error', file=sys.stderr)"], check=True)
        print("progress 2", flush=True)
    print("after", flush=True)
    out, err = capfd.readouterr()
    assert (out, err) == ("before\nafter\n", "")
    assert held.text == ("progress 1\nmultigpu: warning: a warning\nchild\nmultigpu: error: a child "
                         "error\nprogress 2\n")
    assert held.warnings() == "multigpu: warning: a warning\nmultigpu: error: a child error\n"


def test_what_was_held_is_read_when_the_block_ends_in_an_error(capfd):
    try:
        with held_output() as held:
            print("led up to it", flush=True)
            raise RuntimeError("failed")
    except RuntimeError:
        pass
    assert held.text == "led up to it\n" and capfd.readouterr() == ("", "")
