"""The series post 002's comparisons train on (post002_compare.sh): four seeded
noisy sine columns a-d, periods 24, 168, 9 and 700 rows, as a CSV with a header.

    python benchmarks/post002_series.py FILE [ROWS]    (ROWS: 40000)
"""
import sys

import numpy as np


def write(path: str, rows: int = 40000) -> None:
    t = np.arange(rows, dtype=np.float64)
    rng = np.random.default_rng(0)
    cols = [np.sin(t / p) * a + rng.normal(0, 0.1, rows) for p, a in ((24, 1.0), (168, 0.5), (9, 0.3), (700, 2.0))]
    np.savetxt(path, np.stack(cols, 1), delimiter=",", fmt="%.5f", header="a,b,c,d", comments="")


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40000)
