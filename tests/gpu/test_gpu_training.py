"""Training on the GPU against the CPU: each model family (MLP, LeNet-5, the CIFAR-10 model, ResNet), every
optimizer, schedule and mode (skipped without CUDA).

Two towers share GPU 0 (the machine may have one GPU) and two CPU towers run
the same seed (``tests/gpu_compare.py``: weights, buffers, EMA and losses
within a stated relative tolerance, replicas bit-identical on each side).
The tolerances are those of float32 GEMMs summed in another order, grown
over a few steps; a wrong kernel, a stale buffer or a misplaced copy is off
by orders of magnitude more.  ``TOWERS_GPU_REPORT`` records each measured
difference.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import DIGITS, cuda_count, cupy_performance_warnings_fail, run_cli
from tests.gpu_compare import DEVICE, DRY, compare, flat, images, record, rel, train
from towers import Config, Trainer
from towers.data.loading import load_dataset

pytestmark = [pytest.mark.gpu, pytest.mark.dry_run, *cupy_performance_warnings_fail()]


def digits():
    return load_dataset(str(DIGITS))


# -- every model -------------------------------------------------------------------------------------

# ResNet-20 on 8 examples a tower is chaotic: on the CPU alone, weights moved by 3e-7 (relative) at the start
# end 1e-5 apart after one step and 1e-2 after four.  Its rounding differences are checked after one step; the
# end only has to be the same training (a wrong kernel is off from the first step).
CHAOTIC = dict(first=1e-4, accuracy=0.1)

MODELS = {  # model -> (data, steps, final tolerance, compare's options, settings)
    "mlp": (lambda: digits(), 20, 1e-4, {}, dict(hidden=64, batch_size=60)),
    "lenet5": (lambda: images(240, (28, 28)), 5, 1e-4, {}, dict(batch_size=20, optimizer="sgd", lr=0.01,
                                                                 momentum=0.9)),
    "cifar10": (lambda: images(96, (24, 24, 3)), 4, 1e-4, {}, dict(batch_size=12, lr=0.05)),
    "resnet20": (lambda: images(64, (16, 16, 3)), 4, 5e-2, CHAOTIC, dict(batch_size=8, lr=0.05)),
}


@pytest.mark.parametrize("model", sorted(MODELS))
def test_each_model_on_two_towers_sharing_the_gpu_matches_the_cpu(model):
    data, steps, tol, options, settings = MODELS[model]
    gpu, _ = compare(f"model {model}", data(), steps, tol, model=model, n_gpu=2, **options, **settings)
    assert gpu.on_device or DRY  # the training set fits: batches are gathered on the device


# -- every optimizer (the fused update and the EMA inside a step) and every schedule ---------------------------

OPTIMIZERS = {
    "sgd": dict(optimizer="sgd", lr=0.5),
    "momentum": dict(optimizer="sgd", lr=0.2, momentum=0.9),
    "nesterov": dict(optimizer="sgd", lr=0.2, momentum=0.9, nesterov=True),
    "adam": dict(optimizer="adam", lr=0.003),
    "adamw": dict(optimizer="adamw", lr=0.003, weight_decay=0.05),
    "rmsprop": dict(optimizer="rmsprop", lr=0.003),
    "rmsprop centered momentum": dict(optimizer="rmsprop", lr=0.003, rmsprop_centered=True, momentum=0.5),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_each_optimizer_trains_on_the_gpu_as_on_the_cpu(name):
    compare(f"optimizer {name}", digits(), 12, 1e-4, n_gpu=2, hidden=64, batch_size=60, **OPTIMIZERS[name])


SCHEDULES = {
    "exponential staircase": dict(lr_decay=0.5, staircase=True),
    "piecewise": dict(lr_schedule="piecewise", lr_boundaries="3,6", lr_values="0.5,0.2,0.05"),
    "cosine": dict(lr_schedule="cosine", steps=10),
    "warmup": dict(warmup_steps=4),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_each_schedule_on_the_gpu_as_on_the_cpu(name):
    compare(f"schedule {name}", digits(), 10, 1e-4, n_gpu=2, hidden=64, batch_size=60, **SCHEDULES[name])


# -- modes --------------------------------------------------------------------------------------------------


def test_weights_mode_matches_the_cpu():
    compare("sync weights, average every 2", digits(), 10, 1e-4, n_gpu=2, hidden=64, batch_size=60,
            sync="weights", average_every=2, momentum=0.9)


@pytest.mark.parametrize("step", ["run", "batch"])  # batches gathered on the device, or staged from the host
def test_accumulate_matches_the_cpu(step):
    compare(f"accumulate 3 ({step})", digits(), 8, 1e-4, step=step, n_gpu=2, hidden=64, batch_size=20,
            accumulate=3, momentum=0.9)


def test_label_smoothing_matches_the_cpu():
    compare("label smoothing 0.1", digits(), 10, 1e-4, n_gpu=2, hidden=64, batch_size=60, label_smoothing=0.1)


def test_dropout_model_matches_the_cpu():
    from towers.nn.dropout import Dropout
    from towers.nn.layers import Dense, Flatten, ReLU, Sequential

    def model():
        return Sequential([Flatten(), Dense("fc1", 64), ReLU(), Dropout(0.3), Dense("fc2", 10)])

    res = {}
    for devices in (DEVICE, "cpu"):
        cfg = Config(devices=devices, n_gpu=2, batch_size=60, cpu_kernels="numpy", quiet=True, summary_every=0)
        with Trainer(cfg, model=model(), dataset=digits()) as tr:
            tr.run_steps(10)
            res[devices] = flat(tr.get_weights())
    d = rel(res[DEVICE], res["cpu"])
    record("dropout model", weights=d)
    assert d < 1e-4, d


@pytest.mark.parametrize("step", ["run", "batch"])
def test_sync_bn_on_two_towers_sharing_the_gpu_matches_the_cpu(step):
    """sync-BN runs GPU towers on threads; with the training set on the device ("run") their batches are
    gathered there (this crashed before the step engine staged the rows for its tower threads).

    Its first step differs from the CPU's by 1.9e-5 on an H100: on the CPU alone, batch norm's column sums
    taken in float64 instead of OpenBLAS's float32 move sync-BN's weights by the same 1.9e-5 after one step
    (1.2e-6 without sync-BN), so that is the sums' rounding, not the path.
    """
    gpu, _ = compare(f"sync-bn resnet20 ({step})", images(64, (16, 16, 3)), 4, 5e-2, step=step, model="resnet20",
                     n_gpu=2, batch_size=8, lr=0.05, sync_bn=True, **CHAOTIC)
    assert gpu.on_device or DRY


@pytest.mark.parametrize("sync_bn", [False, True])
def test_device_data_and_host_batches_give_the_same_bits(sync_bn):
    """With and without the training set on the device, the same batches reach the towers: the same weights.

    Steps run back to back (no host sync between them).  With sync-BN the
    towers run on threads and gather their rows from the index buffer of
    their own step's upload.
    """
    if sync_bn:
        ds, settings = images(64, (16, 16, 3)), dict(model="resnet20", batch_size=8, lr=0.05, sync_bn=True)
    else:
        ds, settings = digits(), dict(hidden=64, batch_size=20, accumulate=2, momentum=0.9)
    on = train(DEVICE, 8, ds, step="run", n_gpu=2, **settings)
    off = train(DEVICE, 8, ds, step="batch", n_gpu=2, **settings)
    assert on.on_device or DRY
    for name in on.weights:
        np.testing.assert_array_equal(on.weights[name], off.weights[name])


# -- image input ---------------------------------------------------------------------------------------------


def _jpeg_records(path, n=80, size=12):
    from towers.data.image import codec
    from towers.data.image.to_tfrecord import example
    from towers.data.tfrecord.framing import TFRecordWriter

    rng = np.random.default_rng(0)
    y = np.arange(n) % 3
    x = rng.integers(0, 60, (n, size, size), np.uint8)
    for i, label in enumerate(y):
        x[i, : size // 2, (label * size) // 4: (label * size) // 4 + size // 2] += 150
    with open(path, "wb") as f, TFRecordWriter(f, "none") as w:
        for img, label in zip(x, y):
            w.write(example(codec.encode(img[:, :, None], "jpeg"), int(label), img.shape + (1,)))
    return str(path)


@pytest.mark.parametrize("workers,cache", [(0, True), (2, False)])
def test_jpeg_tfrecord_with_cifar_augmentation_through_the_workers_matches_the_cpu(tmp_path, workers, cache):
    """Decoded (once, or every epoch by the input workers) and augmented on the host, staged through the
    pinned buffers."""
    path = _jpeg_records(tmp_path / "d.tfrecords")
    out = []
    for k, devices in enumerate((DEVICE, "cpu")):
        cfg = Config(data=path, x_key="image/encoded", y_key="image/class/label", decode="image/encoded:image:12,12,1",
                     augment="cifar", devices=devices, n_gpu=2, batch_size=10, steps=6, input_workers=workers,
                     cache_images=cache, logdir=str(tmp_path / f"run-{k}"), quiet=True, summary_every=0,
                     cpu_kernels="numpy", model="lenet5")
        with Trainer(cfg) as tr:
            tr.fit()
            assert tr.executor.device_data is None  # augmented each epoch: the examples stay on the host
            out.append(flat(tr.get_weights()))
    d = rel(out[0], out[1])
    record(f"jpeg tfrecord cifar augmentation, {workers} workers, cache {cache}", weights=d)
    assert d < 1e-4, d


# -- checkpoints across devices, replicas, the command line ----------------------------------------------------


def _fit(logdir, devices, steps, resume=False):
    cfg = Config(devices=devices, n_gpu=2, hidden=64, batch_size=60, momentum=0.9, steps=steps, logdir=str(logdir),
                 quiet=True, summary_every=0, checkpoint_every=0, cpu_kernels="numpy", resume=resume)
    with Trainer(cfg) as tr:
        tr.fit()
    with np.load(logdir / "final.npz") as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("first,then", [(DEVICE, "cpu"), ("cpu", DEVICE)])
def test_a_checkpoint_written_on_one_device_resumes_on_the_other(tmp_path, first, then):
    whole = _fit(tmp_path / "whole", then, 30)
    _fit(tmp_path / "split", first, 15)
    resumed = _fit(tmp_path / "split", then, 30, resume=True)
    assert set(resumed) == set(whole)
    keys = [k for k in whole if k.startswith(("params/", "ema/", "momentum/"))]
    d = {k: rel(resumed[k], whole[k]) for k in keys}
    record(f"checkpoint {first} -> {then}", worst=max(d.values()))
    assert max(d.values()) < 1e-4, d
    assert int(resumed["step"]) == 30


def test_cli_with_check_replicas_on_the_gpu(tmp_path):
    res = run_cli("--n-gpu", "2", "--devices", DEVICE, "--hidden", "64", "--steps", "60", "--check-replicas", "10",
                  "--log-placement", "--quiet", "--logdir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "final.npz").exists()
    if not DRY:
        assert "gpu:0" in res.stdout


def _hold_the_legacy_stream(cycles: int = 300_000_000) -> None:
    """Queue a kernel that spins ``cycles`` clock cycles (0.15-0.3 s) on CuPy's legacy default stream (the device
    under test only).

    A copy queued behind it on that stream lands late; the towers' non-blocking
    streams do not wait for it.  So a write between steps that went to the
    legacy stream instead of the tower's would reach the device after the next
    step had read the old values: deterministic, not a matter of copy size.
    """
    if DRY:
        return
    import cupy

    spin = cupy.RawKernel(r"""extern "C" __global__ void spin(long long cycles) {
        long long t0 = clock64();
        while (clock64() - t0 < cycles) { }
    }""", "spin")
    spin((1,), (1,), (np.int64(cycles),), stream=cupy.cuda.Stream.null)


def test_weights_written_between_steps_are_read_by_the_next_step():
    """set_weights, set_weights(ema=True) and load_state_dict between steps (a resume, a parameter server's
    pull): the next step reads the new values, the same as the CPU's sequence.

    The copies run on the towers' stream (``ModelState.set``); with CuPy's legacy default stream busy
    (``_hold_the_legacy_stream``) a copy made there would land after the step queued behind it.
    """
    ds = digits()

    def sequence(devices):
        out = []
        with Trainer(Config(devices=devices, cpu_kernels="numpy", n_gpu=2, hidden=256, batch_size=60, momentum=0.9),
                     dataset=ds) as tr:
            start = {k: v * np.float32(0.5) for k, v in tr.get_weights().items()}
            for _ in range(2):
                tr.run_steps(2)
                _hold_the_legacy_stream()
                tr.set_weights(start)
                tr.run_steps(1)
                out.append(flat(tr.get_weights()))
                state = tr.state_dict()
                tr.run_steps(2)
                _hold_the_legacy_stream()
                tr.load_state_dict(state)
                tr.run_steps(1)
                out.append(flat(tr.get_weights()))
                _hold_the_legacy_stream()
                tr.set_weights(start, ema=True)
                tr.run_steps(1)
                out.append(flat(tr.get_weights(ema=True)))
        return out

    for k, (got, want) in enumerate(zip(sequence(DEVICE), sequence("cpu"))):
        d = rel(got, want)
        record(f"set_weights / load_state_dict then a step ({k})", weights=d)
        assert d < 1e-4, (k, d)


@pytest.mark.skipif(cuda_count() < 2, reason="needs 2 GPUs: the EMA on a GPU other than 0")
def test_the_ema_of_a_tower_on_gpu_1_is_set_there():
    """One tower on GPU 1: the EMA lives there, and set_weights(ema=True) lands there with its values."""
    ds = digits()
    with Trainer(Config(devices="1", hidden=64, batch_size=60), dataset=ds) as tr:
        assert tr.executor.ema.shadow.device.id == 1
        w = {k: v * np.float32(0.25) for k, v in tr.get_weights(ema=True).items()}
        tr.set_weights(w, ema=True)
        got = tr.get_weights(ema=True)
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])
        tr.run_steps(2)
        assert tr.executor.ema.shadow.device.id == 1


# -- CuPy arrays at the API ------------------------------------------------------------------------------------


@pytest.mark.skipif(DRY, reason="needs CuPy arrays")
def test_cupy_arrays_given_to_the_api_are_one_clear_error():
    import cupy

    from towers.errors import UserError

    ds = digits()
    with Trainer(Config(devices=DEVICE, n_gpu=2, hidden=64, batch_size=60), dataset=ds) as tr:
        x, y = ds.x[:120], ds.y[:120]
        with pytest.raises(UserError, match="GPU memory"):
            tr.train_step(cupy.asarray(x), y)
        with pytest.raises(UserError, match="GPU memory"):
            tr.train_step_at(cupy.arange(120))
        w = tr.get_weights()
        name = next(iter(w))
        with pytest.raises(UserError, match="GPU memory"):
            tr.set_weights({**w, name: cupy.asarray(w[name])})
