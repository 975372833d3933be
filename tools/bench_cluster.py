"""Benchmark: towers on 2 local Ray hosts x 1 CPU tower, each sync mode, against 1 host x 2 CPU towers.

Prints, in one run: samples/s of each row and its ratio to the 1-host row;
for grads and weights the time per step each host spends in the cross-host
mean (``towers.cluster.reduce``, inside training: it includes waiting for the
slower host at the barriers); the cross-host mean alone on the model's
gradient buffer between two actors; and, when ``mpi4py`` is installed (``pip
install mpi4py mpich``; a reference, not a dependency), MPI's ``Allreduce``
on the same buffer between two processes.

Hosts on one machine share its cores: by default (``--blas-threads 0``,
towers' own default) each host's BLAS gets its share, cores / hosts, as 1 host
x 2 towers gives each tower thread one BLAS thread; each row says how many
BLAS threads its hosts ran.  ``--blas-threads N`` sets every host's.

``--allreduce-bucket-mib MIB`` (repeatable) adds a grads row per size whose
gradients are averaged in buckets during backward (each host's side of the
cross-host mean on a thread of its own, ``towers.parallel.overlap``), to
compare with the plain grads row.  ``--model`` trains another built-in model,
``--modes`` picks the sync modes' rows.

    python tools/bench_cluster.py [--data ../shared/datasets/mnist24k.npz] [--steps 150] [--model lenet5]
                                  [--modes grads] [--allreduce-bucket-mib 0.01 ...]
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402

import towers  # noqa: E402

WARMUP = 20
ROUNDS = 300


def timed_one_host(cfg: towers.Config, steps: int) -> float:
    """Samples/s of 1 host x 2 towers: ``train_step`` on batches drawn beforehand."""
    with towers.Trainer(cfg) as t:
        batches = [t.source.next_batch() for _ in range(64)]
        for k in range(WARMUP):
            t.train_step(*batches[k % 64])
        t.synchronize()
        t0 = time.perf_counter()
        for k in range(steps):
            t.train_step(*batches[k % 64])
        t.synchronize()
        return steps * t.global_batch / (time.perf_counter() - t0)


def timed_cluster(cfg: towers.Config, steps: int):
    """(samples/s, cross-host ms per step or NaN, each host's BLAS threads) of ``run_steps``: hosts draw their own
    batches."""
    with towers.ClusterTrainer(cfg) as t:
        t.run_steps(WARMUP)
        before = t.executor.cross_host_seconds()
        t0 = time.perf_counter()
        t.run_steps(steps)
        rate = steps * t.global_batch / (time.perf_counter() - t0)
        after = t.executor.cross_host_seconds()
        cross = numpy.nan if after is None else max(a[0] - b[0] for a, b in zip(after, before))  # None: no mean
        return rate, 1e3 * cross / steps, t.executor.host_blas_threads()


class MeanActor:
    """One side of the cross-host mean alone: ``rounds`` averages of an ``n``-float buffer."""

    def __init__(self, handle, rank: int, n: int):
        from towers.cluster.board import Board
        from towers.cluster.reduce import BoardMean

        self.mean = BoardMean(Board.attach(handle), rank, [1, 1])
        self.buf = numpy.random.default_rng(rank).standard_normal(n).astype(numpy.float32)

    def run(self, rounds: int) -> float:
        for _ in range(5):
            self.mean.average([self.buf])
        t0 = time.perf_counter()
        for _ in range(rounds):
            self.mean.average([self.buf])
        return (time.perf_counter() - t0) / rounds


def board_mean_ms(ray, n: int) -> float:
    from towers.cluster.board import Board
    from towers.cluster.reduce import board_spec

    board = Board.create(*board_spec(2, n))
    try:
        actor = ray.remote(MeanActor).options(num_cpus=1)
        pair = [actor.remote(board.handle, r, n) for r in range(2)]
        return 1e3 * max(ray.get([a.run.remote(ROUNDS) for a in pair]))
    finally:
        board.close()


MPI_SCRIPT = """
import sys, time, numpy
from mpi4py import MPI
n, rounds = int(sys.argv[1]), int(sys.argv[2])
comm = MPI.COMM_WORLD
buf = numpy.random.default_rng(comm.rank).standard_normal(n).astype(numpy.float32)
out = numpy.empty_like(buf)
for _ in range(5):
    comm.Allreduce(buf, out)
comm.Barrier()
t0 = time.perf_counter()
for _ in range(rounds):
    comm.Allreduce(buf, out)
    out *= 0.5
dt = comm.reduce((time.perf_counter() - t0) / rounds, op=MPI.MAX)
if comm.rank == 0:
    print(dt)
"""


def mpi_ms(n: int) -> str:
    """MPI's Allreduce (and the scaling to a mean) of ``n`` floats between 2 processes, or why not."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py not installed (pip install mpi4py mpich)"
    mpiexec = shutil.which("mpiexec") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(MPI_SCRIPT)
    try:
        p = subprocess.run([mpiexec, "-n", "2", sys.executable, f.name, str(n), str(ROUNDS)],
                           capture_output=True, text=True, timeout=120)
    finally:
        os.unlink(f.name)
    if p.returncode != 0:
        return "mpiexec failed: " + (p.stderr.strip().splitlines() or ["?"])[-1]
    return f"{1e3 * float(p.stdout.strip().splitlines()[-1]):.3f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=towers.Config().data)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--blas-threads", type=int, default=0,
                    help="every host's BLAS threads (default 0: towers' own, each host's share of the cores)")
    ap.add_argument("--model", default="mlp", help="a built-in model (default mlp)")
    ap.add_argument("--modes", default="grads,weights,ps,async", help="the sync modes' rows (default all four)")
    ap.add_argument("--allreduce-bucket-mib", type=float, action="append", default=[], metavar="MIB",
                    help="add a grads row with the gradients averaged in buckets of MIB during backward (repeatable)")
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    base = dict(devices="cpu", data=args.data, model=args.model, quiet=True, summary_every=0)
    one = timed_one_host(towers.Config(n_gpu=2, **base), args.steps)
    print(f"{'1 host x 2 towers':36s} {one:10.0f} samples/s  1.00")
    hosts = dict(hosts=2, n_gpu=1, blas_threads=args.blas_threads, **base)
    extras = {"grads": {}, "weights": {"average_every": 10}, "ps": {}, "async": {}}
    rows = [(sync, sync, extras[sync]) for sync in args.modes.split(",")]
    rows += [(f"grads, buckets {mib:g} MiB", "grads", {"allreduce_bucket_mib": mib}) for mib in args.allreduce_bucket_mib]
    for name, sync, extra in rows:
        rate, cross, blas = timed_cluster(towers.Config(sync=sync, **hosts, **extra), args.steps)
        note = f"  BLAS threads {'+'.join(map(str, blas))}"
        note += f"  cross-host mean {cross:.3f} ms/step" if cross == cross else ""
        print(f"{'2 hosts x 1 tower, ' + name:36s} {rate:10.0f} samples/s  {rate / one:.2f}{note}", flush=True)
    with towers.Trainer(towers.Config(**base)) as t:
        n = t.model.size
    print(f"cross-host mean alone, {n:,} floats, 2 actors: {board_mean_ms(ray, n):.3f} ms; "
          f"MPI Allreduce + scale, 2 processes: {mpi_ms(n)}")
    ray.shutdown()


if __name__ == "__main__":
    main()
