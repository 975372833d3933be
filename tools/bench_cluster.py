"""Benchmark: towers on 2 local Ray hosts x 1 CPU tower, each sync mode, against 1 host x 2 CPU towers.

Prints samples/s of each row, measured in one run, their ratio to the 1-host
row, and for grads and weights the time per step each host spends in the
cross-host mean (``towers.cluster.reduce``: two object-store exchanges).

    python tools/bench_cluster.py [--data ../shared/datasets/mnist24k.npz] [--steps 600]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import towers  # noqa: E402


def timed(trainer, steps: int, warmup: int = 20) -> float:
    """Samples/s of ``steps`` train_step calls after ``warmup`` (batches drawn beforehand)."""
    batches = [trainer.source.next_batch() for _ in range(64)]
    for k in range(warmup):
        trainer.train_step(*batches[k % 64])
    trainer.synchronize()
    t0 = time.perf_counter()
    for k in range(steps):
        trainer.train_step(*batches[k % 64])
    trainer.synchronize()
    return steps * trainer.global_batch / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=towers.Config().data)
    ap.add_argument("--steps", type=int, default=600)
    args = ap.parse_args()
    import ray

    from towers.cluster.driver import ClusterTrainer

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    base = dict(devices="cpu", data=args.data, quiet=True, summary_every=0)
    with towers.Trainer(towers.Config(n_gpu=2, **base)) as t:
        one = timed(t, args.steps)
    print(f"{'1 host x 2 towers':28s} {one:10.0f} samples/s  1.00")
    for sync, extra in (("grads", {}), ("weights", {"average_every": 10}), ("ps", {})):
        with ClusterTrainer(towers.Config(hosts=2, n_gpu=1, sync=sync, **base, **extra)) as t:
            rate = timed(t, args.steps)
            cross = max(t.cross_host_seconds()) if sync != "ps" else float("nan")
        note = f"  cross-host mean {1e3 * cross / (args.steps + 20):.2f} ms/step" if cross == cross else ""
        print(f"{'2 hosts x 1 tower, ' + sync:28s} {rate:10.0f} samples/s  {rate / one:.2f}{note}")
    # async has no train_step (hosts run at their own pace): timed through fit.
    with ClusterTrainer(towers.Config(hosts=2, n_gpu=1, sync="async", steps=args.steps, checkpoint_every=0,
                                      logdir=f"/tmp/bench_cluster_async_{os.getpid()}", **base)) as t:
        t0 = time.perf_counter()
        result = t.fit()
        rate = args.steps * t.global_batch / (time.perf_counter() - t0)
    print(f"{'2 hosts x 1 tower, async':28s} {rate:10.0f} samples/s  {rate / one:.2f}"
          f"  (per update {t.global_batch} examples; staleness mean {result['staleness_mean']:.2f})")
    ray.shutdown()


if __name__ == "__main__":
    main()
