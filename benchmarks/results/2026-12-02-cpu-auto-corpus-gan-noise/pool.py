"""Pooled figures over corpus calls: every --auto run and every one-process run of each script
(the one-process runs of a call given to another as --baseline counted once), with a Mann-Whitney U test
of the --auto metrics against the one-process ones.

    python pool.py call1.json call2.json call3.json [call4.json]
"""
import json
import statistics as st
import sys


def mann_whitney(a: list[float], b: list[float]) -> tuple[float, float]:
    """U of a against b and its normal z (no ties correction: the metrics are floats)."""
    u = sum((x > y) + 0.5 * (x == y) for x in a for y in b)
    mean = len(a) * len(b) / 2
    sd = (len(a) * len(b) * (len(a) + len(b) + 1) / 12) ** 0.5
    return u, (u - mean) / sd


def pool(files: list[str]) -> tuple[dict, dict]:
    autos: dict[str, list[float]] = {}
    ones: dict[str, list[float]] = {}
    counted = set()  # (script, one call's one-process metrics): a baseline is that call's own
    for f in files:
        with open(f) as fh:
            summary = json.load(fh)["summary"]
        for name, s in summary.items():
            autos.setdefault(name, []).extend(v["metric"] for v in s.values() if isinstance(v, dict))
            for runs in (s.get("one_process_here"), s["one_process"]):
                if runs is not None and (name, tuple(runs)) not in counted:
                    counted.add((name, tuple(runs)))
                    ones.setdefault(name, []).extend(runs)
    return autos, ones


def main(files: list[str]) -> None:
    autos, ones = pool(files)
    for name, a in autos.items():
        o = ones[name]
        u, z = mann_whitney(a, o)
        outside = sum(not min(o) <= x <= max(o) for x in a)
        print(f"{name}: --auto {len(a)} runs mean {st.mean(a):.5f} sd {st.stdev(a):.5f} | "
              f"one process {len(o)} runs mean {st.mean(o):.5f} sd {st.stdev(o):.5f} "
              f"range {min(o):.5g}-{max(o):.5g} | --auto outside that range: {outside} | "
              f"Mann-Whitney U {u:g}, z {z:+.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
