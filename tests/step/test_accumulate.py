"""Gradient accumulation (``accumulate`` K): K micro-batches per tower, one all-reduce and one update per step.

References, each computed by code that does not accumulate: the mean
gradient of the whole batch (a float64 replica), a run with K times the
per-tower batch (no batch norm), a run with K times the towers (batch norm
and dropout per micro-batch), a sync-BN step per micro-batch, an
uninterrupted run (resume), one host with every tower (several hosts).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy
import pytest

import towers
from tests import commands
from towers.nn.replica import Replica
from towers.settings import BATCH, resume_changes

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(devices="cpu", hidden=32, quiet=True, summary_every=0, log_every=1000, checkpoint_every=0)


def trainer(model=None, **kw):
    return towers.Trainer(towers.Config(**{**SMALL, **kw}), model=model)


def bn_model(dropout: bool = True):
    return [towers.Flatten(), towers.Dense("fc1", 24), towers.BatchNorm("bn"), towers.ReLU()] + (
        [towers.Dropout(0.3)] if dropout else []) + [towers.Dense("fc2", 10)]


def test_micro_batches_give_the_whole_batchs_mean_loss_and_gradient_with_l2_once():
    """float64 so that the only difference left is the order of the sums."""
    model = towers.Sequential([towers.Flatten(), towers.Dense("fc1", 12), towers.ReLU(),
                               towers.Dense("fc2", 5)]).build((4, 3))
    rng = numpy.random.default_rng(1)
    x, y = rng.standard_normal((12, 4, 3)), rng.integers(0, 5, 12)
    one, acc = (Replica(model, numpy, dtype=numpy.float64) for _ in range(2))
    for r in (one, acc):
        r.set_params(model.init_params(0))
    want = float(one.mean_loss_and_grads(((x, y),), 1, 0.01))
    got = float(acc.mean_loss_and_grads(((x[k * 4:(k + 1) * 4], y[k * 4:(k + 1) * 4]) for k in range(3)), 3, 0.01))
    assert got == pytest.approx(want, rel=1e-12)
    numpy.testing.assert_allclose(acc.grads, one.grads, rtol=1e-12, atol=1e-15)
    # The next step reuses the scratch buffer: no stale gradient of the last one.
    x2 = rng.standard_normal((12, 4, 3))
    one.loss_and_grads(x2, y, 0.01)
    acc.mean_loss_and_grads(((x2[k * 4:(k + 1) * 4], y[k * 4:(k + 1) * 4]) for k in range(3)), 3, 0.01)
    numpy.testing.assert_allclose(acc.grads, one.grads, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("kw", [dict(model="mlp"), dict(model="lenet5", optimizer="sgd", lr=0.05),
                                dict(model="mlp", sync="weights", average_every=2, momentum=0.9)],
                         ids=["mlp", "lenet5", "weights-mode"])
def test_two_micro_batches_train_like_twice_the_batch_per_tower(kw):
    """2 towers x 25 x K=2 against 2 towers x 50: the same examples per tower, schedule and position."""
    steps = 6
    with trainer(n_gpu=2, batch_size=25, accumulate=2, steps=steps, **kw) as acc, \
            trainer(n_gpu=2, batch_size=50, steps=steps, **kw) as big:
        assert acc.global_batch == big.global_batch == acc.examples_per_step == 100
        losses = [acc.run_steps(steps, want_loss=True), big.run_steps(steps, want_loss=True)]
        assert [acc.lr_at(s) for s in range(20)] == [big.lr_at(s) for s in range(20)]
        sa, sb = acc.state_dict(), big.state_dict()
        for key in ("data/epoch", "data/index", "step", "global_batch"):
            assert int(sa[key]) == int(sb[key]), key
        if kw.get("sync") != "weights":
            assert acc.all_reduces == big.all_reduces == steps  # one all-reduce per step, whatever K
        assert acc.check_replicas()
        got, want = acc.get_weights(), big.get_weights()
        for k in want:
            numpy.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
        numpy.testing.assert_allclose([float(v) for v in losses[0]], [float(v) for v in losses[1]], rtol=1e-5)


def test_threaded_and_serial_towers_accumulate_alike_and_allocate_the_scratch_once():
    out = []
    for mode in ("threads", "serial"):
        with trainer(n_gpu=2, batch_size=25, accumulate=3, momentum=0.9, cpu_towers=mode, steps=4) as t:
            t.run_steps(1)
            scratch = [tw.replica._scratch[0] for tw in t.executor.towers]
            t.run_steps(3)
            assert all(tw.replica._scratch[0] is s for tw, s in zip(t.executor.towers, scratch))
            out.append(t.get_weights())
    for k in out[0]:
        numpy.testing.assert_array_equal(out[0][k], out[1][k], err_msg=k)


def test_micro_batches_have_their_own_batch_statistics_and_dropout_masks():
    """1 tower x 25 x K=2 is 2 towers x 25: batch norm and dropout see each micro-batch as a tower's batch."""
    with trainer(bn_model(), n_gpu=1, batch_size=25, accumulate=2, steps=5) as acc, \
            trainer(bn_model(), n_gpu=2, batch_size=25, steps=5) as two, \
            trainer(bn_model(), n_gpu=1, batch_size=50, steps=5) as big:
        for t in (acc, two, big):
            t.run_steps(5)
        got, want, whole = acc.get_weights(), two.get_weights(), big.get_weights()
    for k in ("fc1/weights", "bn/gamma", "fc2/weights"):
        numpy.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
        assert not numpy.allclose(got[k], whole[k], rtol=1e-3, atol=1e-4), k  # not one batch of 50


def test_sync_bn_averages_each_micro_batchs_statistics_across_towers():
    """2 towers x K=2 with sync-BN: the mean of two sync-BN steps, one per micro-batch, from the same weights."""
    with trainer(bn_model(dropout=False), n_gpu=2, batch_size=25, accumulate=2, sync_bn=True, steps=1) as acc, \
            trainer(bn_model(dropout=False), n_gpu=2, batch_size=25, sync_bn=True, steps=1) as ref:
        x, y = acc.dataset.x[:100], acc.dataset.y[:100]
        acc.train_step(x, y)
        got = acc.get_gradients()
        start, means = ref.get_weights(), []
        for k in range(2):
            rows = numpy.r_[k * 25:(k + 1) * 25, 50 + k * 25:50 + (k + 1) * 25]  # micro-batch k of each tower
            ref.set_weights(start)
            ref.train_step(x[rows], y[rows])
            means.append(ref.get_gradients())
    for k in got:
        numpy.testing.assert_allclose(got[k], (means[0][k] + means[1][k]) / 2, rtol=1e-5, atol=1e-6, err_msg=k)


def test_accumulate_is_checked_and_counted_in_the_global_batch():
    # On resume it is treated as batch_size is: the tower x batch note (the test below shows it).
    old = dataclasses.asdict(towers.Config().resolved())
    assert resume_changes(old, towers.Config(accumulate=2).resolved())[BATCH] == [("accumulate", 1, 2)]
    with pytest.raises(towers.UserError, match="accumulate must be an integer >= 1"):
        trainer(accumulate=0)
    with pytest.raises(towers.UserError, match="larger than the dataset.*accumulate"):
        trainer(n_gpu=2, batch_size=400, accumulate=2)
    with trainer(n_gpu=2, batch_size=10, accumulate=3) as t:
        with pytest.raises(towers.UserError, match=r"60 examples .*2 towers x batch_size 10 x accumulate 3"):
            t.train_step(t.dataset.x[:20], t.dataset.y[:20])


def _train(logdir, *args):
    p = commands.run("towers.train", "--logdir", logdir, "--hidden", "16", "--quiet", "--summary-every", "0",
                     "--n-gpu", "2", "--batch-size", "25", "--accumulate", "2", "--momentum", "0.9",
                     "--checkpoint-every", "7", *args, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    return p


def test_resume_with_accumulate_is_byte_identical(tmp_path):
    # 100 examples a step cross the epoch boundary (1438 examples) before step 20.
    _train(tmp_path / "whole", "--steps", 30)
    _train(tmp_path / "split", "--steps", 20)
    p = _train(tmp_path / "split", "--steps", 30, "--resume")
    assert "ckpt-00000020.npz" in p.stdout and "note:" not in p.stdout + p.stderr
    assert (tmp_path / "whole" / "final.npz").read_bytes() == (tmp_path / "split" / "final.npz").read_bytes()
    with numpy.load(tmp_path / "split" / "ckpt-00000020.npz") as z:
        assert (int(z["global_batch"]), int(z["data/epoch"]), int(z["data/index"])) == (100, 1, 2000 - 1438)
    # Another K is another global batch, or the same one split otherwise: the tower x batch note says which.
    p = _train(tmp_path / "split", "--steps", 35, "--resume", "--batch-size", 50, "--accumulate", 1)
    assert ("written by 2 tower(s) x 25 x 2 micro-batches, this run has 2 x 50 x 1 micro-batches: the same "
            "global batch") in p.stdout + p.stderr
    p = _train(tmp_path / "split", "--steps", 40, "--resume", "--accumulate", 3)
    assert "the global batch changes from 100 to 150" in p.stdout + p.stderr


@pytest.mark.parametrize("sync", ["grads", "ps"])
def test_two_hosts_take_their_slices_of_micro_batches(local_ray, sync):
    """2 hosts x 1 tower x 25 x K=2 is 1 host x 2 towers x 25 x K=2."""
    with trainer(n_gpu=2, batch_size=25, accumulate=2, steps=3) as one:
        one.run_steps(3)
        want, want_position = one.get_weights(), one.state_dict()["data/index"]
    with trainer(hosts=2, n_gpu=1, batch_size=25, accumulate=2, sync=sync, steps=3) as t:
        assert t.global_batch == 100
        t.run_steps(3)
        got, state = t.get_weights(), t.state_dict()
    assert int(state["data/index"]) == int(want_position) == 300 and int(state["global_batch"]) == 100
    for k in want:
        numpy.testing.assert_allclose(got[k], want[k], rtol=0 if sync == "grads" else 1e-6,
                                      atol=0 if sync == "grads" else 1e-7, err_msg=k)


@pytest.mark.gpu
def test_micro_batches_gathered_on_the_gpu_are_the_host_pipelines():
    """With the training set on the GPU each micro-batch is gathered there: the host-staged run, bit for bit."""
    from towers.data.batches import BatchSource

    out = []
    for on_device in (True, False):
        with trainer(n_gpu=2, devices="0", batch_size=30, accumulate=2, momentum=0.9) as t:
            assert t.executor.device_data is not None  # the digits fit
            src = BatchSource(t.dataset, 120, 0)
            for _ in range(15):
                idx = src.next_indices()
                if on_device:
                    t.train_step_at(idx)
                else:
                    t.train_step(t.dataset.x[idx], t.dataset.y[idx])
            out.append(t.get_weights())
    with trainer(n_gpu=2, devices="0", batch_size=60, momentum=0.9) as t:
        src = BatchSource(t.dataset, 120, 0)
        for _ in range(15):
            t.train_step_at(src.next_indices())
        whole = t.get_weights()
    for name in out[0]:
        numpy.testing.assert_array_equal(out[0][name], out[1][name])
        numpy.testing.assert_allclose(out[0][name], whole[name], rtol=1e-5, atol=1e-6, err_msg=name)
