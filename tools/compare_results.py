"""Run a fixed set of training jobs from a checkout and record what they wrote, to compare two checkouts.

A refactoring that must not change results runs this on the commit before
and on its own, then compares:

    python tools/compare_results.py run /path/to/base base.json
    python tools/compare_results.py run . mine.json
    python tools/compare_results.py compare base.json mine.json

Each job is ``python -m towers.train`` run in the checkout (its own
``towers``), with ``--quiet --summary-every 0`` and a fresh ``--logdir``; the
record is the md5 of its ``final.npz``.  Deterministic jobs must match byte
for byte.  ``--sync async`` is nondeterministic by design (the server applies
whichever host's gradient arrives first): its one-step job runs ``ASYNC_TRIES``
times and records the set of md5s seen (each is one host's first gradient
applied to the common initial weights, so the sets of two checkouts must
overlap and hold at most one md5 per host); its 300-step job records the
staleness the summary line reports, compared as ranges (printed, not
judged).  Jobs on 2 hosts start a local Ray each (about 10-20 s on 2 cores).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile

BASE = ["--n-gpu", "2", "--steps", "300", "--quiet", "--summary-every", "0"]
HOSTS = ["--hosts", "2", "--n-gpu", "1", "--steps", "300", "--quiet", "--summary-every", "0"]
JOBS = {
    "default": BASE,
    "adam": BASE + ["--optimizer", "adam"],
    "weights K=4 momentum 0.9": BASE + ["--sync", "weights", "--average-every", "4", "--momentum", "0.9"],
    "2 hosts grads": HOSTS,
    "2 hosts ps": HOSTS + ["--sync", "ps"],
    "lenet5 20 steps batch 20": BASE + ["--model", "lenet5", "--steps", "20", "--batch-size", "20"],
    "resnet20 6 steps batch 8": BASE + ["--model", "resnet20", "--steps", "6", "--batch-size", "8"],
}
ASYNC_ONE = HOSTS + ["--sync", "async", "--steps", "1"]
ASYNC_LONG = HOSTS + ["--sync", "async"]
ASYNC_TRIES = 3


def train(checkout: str, args: list[str]) -> tuple[str, str]:
    """(md5 of final.npz, stdout) of one job run from ``checkout``."""
    with tempfile.TemporaryDirectory() as logdir:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
        p = subprocess.run([sys.executable, "-m", "towers.train", *args, "--logdir", logdir], cwd=checkout,
                           env=env, capture_output=True, text=True)
        if p.returncode != 0:
            raise SystemExit(f"{' '.join(args)}: exit {p.returncode}\n{p.stderr}")
        with open(os.path.join(logdir, "final.npz"), "rb") as f:
            return hashlib.md5(f.read()).hexdigest(), p.stdout


def run(checkout: str, out: str) -> None:
    record = {}
    for name, args in JOBS.items():
        record[name] = train(checkout, args)[0]
        print(f"{name:28s} {record[name]}", flush=True)
    record["async 1 step"] = sorted({train(checkout, ASYNC_ONE)[0] for _ in range(ASYNC_TRIES)})
    print(f"{'async 1 step':28s} {' '.join(record['async 1 step'])}", flush=True)
    stale = []
    for _ in range(2):
        m = re.search(r"gradient staleness mean ([0-9.]+), max (\d+)", train(checkout, ASYNC_LONG)[1])
        stale.append([float(m.group(1)), int(m.group(2))] if m else None)
    record["async 300 steps staleness (mean, max)"] = stale
    print(f"{'async 300 steps staleness':28s} {stale}", flush=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


def compare(a_path: str, b_path: str) -> int:
    with open(a_path) as f:
        a = json.load(f)
    with open(b_path) as f:
        b = json.load(f)
    bad = 0
    print(f"| job | {os.path.basename(a_path)} | {os.path.basename(b_path)} | same |\n| --- | --- | --- | --- |")
    for name in a:
        x, y = a[name], b.get(name)
        if name.startswith("async 300"):
            same = "(ranges, not judged)"
        elif isinstance(x, list):
            ok = bool(set(x) & set(y or [])) and len(set(x) | set(y or [])) <= 2  # one outcome per host
            same, bad = ("yes" if ok else "NO"), bad + (not ok)
        else:
            same, bad = ("yes" if x == y else "NO"), bad + (x != y)
        show = (lambda v: " ".join(v) if isinstance(v, list) and v and isinstance(v[0], str) else str(v))
        print(f"| {name} | {show(x)} | {show(y)} | {same} |")
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "run":
        run(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        raise SystemExit(__doc__)
