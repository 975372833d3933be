"""Sync modes (gradients every step, weights every K steps) and the replica check."""
import numpy as np
import pytest

from tests.conftest import DIGITS, run_cli
from towers.errors import TrainingError
from towers.data.batches import BatchSource
from towers.data.loading import load_dataset
from towers import Config, Trainer
from towers.train import run


def rel_diff(a, b):
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def test_weights_every_step_with_plain_sgd_equals_gradient_averaging(tmp_path):
    out = {}
    for sync in ("grads", "weights"):
        cfg = Config(n_gpu=2, devices="cpu", steps=20, hidden=64, batch_size=60, sync=sync,
                     logdir=str(tmp_path / sync), quiet=True)
        run(cfg)
        with np.load(tmp_path / sync / "final.npz") as z:
            out[sync] = {k: z[k] for k in z.files}
    for key, ref in out["grads"].items():
        if key != "step":
            assert rel_diff(out["weights"][key], ref) < 1e-5, key
    assert rel_diff(out["grads"]["params/layer1/weights"], out["grads"]["ema/layer1/weights"]) > 1e-4


def make(sync="grads", k=1, momentum=0.0, n=2, standin=None):
    """A trainer on CPU towers; with the NCCL ``standin``, its towers keep their own weights in grads mode too
    (plain CPU towers share one buffer there, so a replica check has nothing to compare)."""
    cfg = Config(n_gpu=n, devices="cpu", hidden=16, batch_size=40, sync=sync, average_every=k, momentum=momentum)
    ds = load_dataset(str(DIGITS))
    tr = Trainer(cfg, dataset=ds, reducer=standin.reducer(n) if standin else None)
    if standin:
        for r in tr.executor.replicas:
            standin.register(r.grads)
    src = BatchSource(ds, cfg.batch_size * n, cfg.seed)
    return tr, src


@pytest.mark.parametrize("momentum, per_average", [(0.0, 1), (0.9, 2)])
def test_weights_mode_averages_every_k_steps(momentum, per_average):
    tr, src = make("weights", k=5, momentum=momentum)
    for step in range(1, 13):
        tr.train_step(*src.next_batch())
        tr.synchronize()  # join the tower threads before reading their replicas
        same = np.array_equal(tr.executor.replicas[0].params, tr.executor.replicas[1].params)
        assert same == (step % 5 == 0), step  # towers drift apart between averages
        assert tr.check_replicas() == (step % 5 == 0)
    assert tr.all_reduces == 2 * per_average  # two averages in 12 steps
    ema_before = tr.executor.ema.shadow.copy()
    tr.finish()  # steps 11-12 are averaged at the end, and the EMA follows
    assert tr.all_reduces == 3 * per_average
    assert np.array_equal(tr.executor.replicas[0].params, tr.executor.replicas[1].params)
    assert not np.array_equal(ema_before, tr.executor.ema.shadow)
    if momentum:
        assert np.array_equal(tr.executor.optimizers[0].velocity, tr.executor.optimizers[1].velocity)


@pytest.mark.parametrize("sync", ["grads", "weights"])
def test_first_ema_update_counts_itself_as_tensorflow_does(sync):
    """After the first update (or first weight average) the EMA's decay is min(0.99, 2/11), TF's global_step 1."""
    tr, src = make(sync, k=1)
    e0 = tr.get_weights(ema=True)
    tr.train_step(*src.next_batch())
    tr.synchronize()
    p1, e1 = tr.get_weights(), tr.get_weights(ema=True)
    for name, e in e1.items():
        want = e0[name] - (1 - 2 / 11) * (e0[name] - p1[name])
        np.testing.assert_allclose(e, want, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("sync", ["grads", "weights"])
def test_replica_check_names_the_tower_and_the_largest_difference(sync, standin):
    tr, src = make(sync, k=1, n=3, standin=standin if sync == "grads" else None)
    for _ in range(3):
        tr.train_step(*src.next_batch())
    assert tr.check_replicas()
    tr.executor.replicas[2].param["layer2/biases"][3] += 0.25
    with pytest.raises(TrainingError, match=r"step 3: tower 2 differs from tower 0 by up to 0\.25 "
                                            r"\(at layer2/biases\[3\]\)"):
        tr.check_replicas()


def test_grads_mode_check_is_bitwise(standin):
    tr, src = make("grads", standin=standin)
    tr.train_step(*src.next_batch())
    tr.synchronize()
    flat = tr.executor.replicas[1].params
    flat[0] = np.nextafter(flat[0], np.float32(np.inf))  # one ulp
    with pytest.raises(TrainingError, match="tower 1"):
        tr.check_replicas()


def test_summary_reports_all_reduces_per_step(tmp_path):
    res = run_cli("--devices", "cpu", "--n-gpu", "2", "--steps", "40", "--sync", "weights",
                  "--average-every", "10", "--check-replicas", "15", "--quiet", "--logdir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "weights sync, 0.10 all-reduces/step" in res.stdout


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--sync", "asynch"], "--sync 'asynch' is unknown"),
        (["--sync", "async"], "--sync async is a parameter server for several hosts: set --hosts 2"),
        (["--average-every", "5"], "--average-every applies to --sync weights"),
        (["--sync", "weights", "--average-every", "0"], "--average-every must be an integer >= 1"),
    ],
)
def test_bad_sync_flags(tmp_path, args, needle):
    res = run_cli(*args, "--devices", "cpu", "--logdir", str(tmp_path / "o"))
    assert res.returncode == 2 and needle in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()
