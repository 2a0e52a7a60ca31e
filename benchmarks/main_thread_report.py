"""Where a process's main thread was during a loop: the samples of main_thread_sampler/.

    python benchmarks/main_thread_report.py DIR --within engine.py:train_epoch [--json OUT]
    python benchmarks/main_thread_report.py DIR --within measure.py:time_trial

Of each samples-<pid>.jsonl in DIR, the samples whose stack holds a frame of --within
("file:function", as the sampler names it) are split into spans where they stop for more than
--gap seconds (each epoch's train_epoch call; each bench trial). Per span: its length, the
share of samples in each scheduler state (R: on a CPU or runnable; S: asleep, e.g. waiting on a
lock, a queue or the GPU; D: in the disk), the line of --within and the function it called there
(where the loop was), and the innermost frames (where the thread was), each with its R share.
"""
import argparse
import collections
import json
from pathlib import Path


def load(path: Path) -> tuple[dict[int, list[str]], list[tuple[float, str, int]]]:
    stacks, samples = {}, []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by the process's end
        if "stack" in rec:
            stacks[rec["stack"]] = rec["frames"]
        else:
            samples += [(rec["t0"] + ms / 1000, state, i) for ms, state, i in rec["s"]]
    return stacks, samples


def spans(samples: list, gap: float) -> list[list]:
    out = []
    for s in samples:
        if out and s[0] - out[-1][-1][0] <= gap:
            out[-1].append(s)
        else:
            out.append([s])
    return out


def _is(frame: str, within: str) -> bool:
    return frame.rsplit(":", 1)[0].endswith(within)


def where(frames: list[str], within: str) -> tuple[str, str]:
    """(the line of `within`, the function it called there) of one stack (innermost first)."""
    for i, f in enumerate(frames):
        if _is(f, within):
            callee = frames[i - 1].rsplit(":", 1)[0] if i > 0 else "(itself)"
            return f, callee
    return "?", "?"


def innermost(frames: list[str], prefix: str | None) -> str:
    for f in frames:
        if prefix is None or f.startswith(prefix):
            return f
    return frames[0] if frames else "?"


def table(counter: collections.Counter, running: collections.Counter, n: int, top: int) -> list[dict]:
    return [{"at": k, "share": round(c / n, 3), "running": round(running[k] / c, 2)}
            for k, c in counter.most_common(top)]


def summarise(span: list, stacks: dict, within: str, top: int) -> dict:
    n = len(span)
    states = collections.Counter(s for _, s, _ in span)
    at, leaf, ours = (collections.Counter() for _ in range(3))
    at_r, leaf_r, ours_r = (collections.Counter() for _ in range(3))
    for _, state, i in span:
        frames = stacks.get(i, [])
        line, callee = where(frames, within)
        keys = ((at, at_r, f"{line} -> {callee}"), (leaf, leaf_r, innermost(frames, None)),
                (ours, ours_r, innermost(frames, "multigpu/")))
        for counter, running, key in keys:
            counter[key] += 1
            if state == "R":
                running[key] += 1
    thirds = []
    for k in range(3):
        part = span[k * n // 3:(k + 1) * n // 3]
        leaf3 = collections.Counter(innermost(stacks.get(i, []), None) for _, _, i in part)
        thirds.append({"running": round(sum(s == "R" for _, s, _ in part) / max(len(part), 1), 3),
                       "innermost": [[k2, round(c / len(part), 3)] for k2, c in leaf3.most_common(3)]})
    return {"start": span[0][0], "seconds": round(span[-1][0] - span[0][0], 2), "samples": n,
            "thirds": thirds,
            "states": {k: round(v / n, 3) for k, v in states.most_common()},
            "loop_at": table(at, at_r, n, top), "innermost": table(leaf, leaf_r, n, top),
            "innermost_multigpu": table(ours, ours_r, n, top)}


def show(name: str, k: int, s: dict) -> None:
    states = ", ".join(f"{a} {b:.0%}" for a, b in s["states"].items())
    print(f"{name} span {k} (from {s['start']:.1f}): {s['seconds']} s, {s['samples']} samples; {states}")
    for j, third in enumerate(s["thirds"], 1):
        tops = "; ".join(f"{at} {share:.0%}" for at, share in third["innermost"])
        print(f"  third {j}: R {third['running']:.0%}; {tops}")
    for title in ("loop_at", "innermost", "innermost_multigpu"):
        print(f"  {title}:")
        for row in s[title]:
            print(f"    {row['share']:6.1%}  (R {row['running']:.0%})  {row['at']}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--within", required=True, help="file:function of the loop, e.g. engine.py:train_epoch")
    p.add_argument("--gap", type=float, default=0.5)
    p.add_argument("--min-seconds", type=float, default=2.0, help="spans shorter than this are left out")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--json")
    a = p.parse_args()
    found = {}
    for path in sorted(Path(a.dir).glob("samples-*.jsonl")):
        stacks, samples = load(path)
        inside = [s for s in samples if any(_is(f, a.within) for f in stacks.get(s[2], []))]
        result = [summarise(sp, stacks, a.within, a.top) for sp in spans(inside, a.gap)
                  if sp[-1][0] - sp[0][0] >= a.min_seconds]
        if result:
            found[path.name] = result
            for k, s in enumerate(result, 1):
                show(path.name, k, s)
    if a.json:
        Path(a.json).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
