"""Where a process's start-up went, in time order: a py-spy speedscope profile (`py-spy record -f
speedscope --threads -o P.json -- python -m multigpu train ...`) cut into windows, each with the
two stacks that took most of a thread's samples in it, named by the deepest multigpu frame (or
the script's), the call it made there and the leaf.

    python benchmarks/startup_timeline.py P.json --until 14 --step 0.5 [--thread NAME]

The thread: the one whose name holds NAME, by default the one with the most samples (the main
thread; py-spy does not always read the threads' names).

Times are seconds since py-spy started the command (its own start is not in them).
"""
import argparse
import collections
import json


def label(frames: list[dict], stack: list[int], ours: tuple[str, ...]) -> str:
    named = [frames[i] for i in stack]
    deepest = max((i for i, f in enumerate(named) if any(o in f.get("file", "") for o in ours)),
                  default=None)
    if deepest is None:
        return "-"
    own = named[deepest]
    parts = [f"{own.get('file', '').rsplit('/', 1)[-1]}:{own['name']}:{own.get('line')}"]
    below = named[deepest + 1:]
    for f in below[:1] + below[-1:] if len(below) > 1 else below:
        parts.append(f"{f['name']} ({f.get('file', '').rsplit('/', 1)[-1]})")
    return " > ".join(parts)


def windows(profile: dict, frames: list[dict], until: float, step: float, ours: tuple[str, ...]):
    """{window's start: Counter(label -> seconds)} for the samples before `until`."""
    bins: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    at = 0.0
    for stack, weight in zip(profile["samples"], profile["weights"]):
        if at >= until:
            break
        bins[int(at / step)][label(frames, stack, ours)] += weight
        at += weight
    return bins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile")
    parser.add_argument("--until", type=float, default=15.0)
    parser.add_argument("--step", type=float, default=0.5)
    parser.add_argument("--thread", help="a part of the thread's name (default: the busiest)")
    parser.add_argument("--ours", default="multigpu,startup_bare", help="files counted as ours")
    args = parser.parse_args()
    data = json.load(open(args.profile))
    frames = data["shared"]["frames"]
    busiest = max(data["profiles"], key=lambda p: len(p["samples"]))
    for profile in data["profiles"]:
        if (args.thread not in profile["name"]) if args.thread else profile is not busiest:
            continue
        print(f"# {profile['name']}: {len(profile['samples'])} samples")
        bins = windows(profile, frames, args.until, args.step, tuple(args.ours.split(",")))
        for b in sorted(bins):
            top = " | ".join(f"{k} {v:.2f}" for k, v in bins[b].most_common(2))
            print(f"{b * args.step:6.2f} {sum(bins[b].values()):4.2f} {top}")


if __name__ == "__main__":
    main()
