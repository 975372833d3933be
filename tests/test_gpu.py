"""GPU runs compared with the CPU run of the same seed (skipped without CUDA).

CuPy's PerformanceWarning (an array used on the wrong device, i.e. hidden peer
access) is an error here.
"""
import numpy as np
import pytest

from conftest import DIGITS, cuda_count, run_cli
from towers.data.batches import BatchSource
from towers.data.loading import load_dataset
from towers.devices.placement import resolve, to_host
from towers import Config, Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("error::cupy._util.PerformanceWarning")]


def train(n, devices, steps=20, momentum=0.9):
    cfg = Config(n_gpu=n, devices=devices, hidden=64, batch_size=60, momentum=momentum)
    ds = load_dataset(str(DIGITS))
    tr = Trainer(cfg, dataset=ds)
    src = BatchSource(ds, cfg.batch_size * n, cfg.seed)
    losses = []
    for step in range(steps):
        out = tr.train_step(*src.next_batch(), want_loss=step == steps - 1)
    losses = [float(v) for v in out]
    tr.synchronize()
    params = [to_host(r.params) for r in tr.replicas]
    ema = to_host(tr.ema.shadow)
    acc = tr.evaluate(use_ema=True)[1]
    tr.close()
    return params, ema, losses, acc


def close_to_cpu(gpu, cpu, tol=1e-4):
    g_params, g_ema, g_loss, g_acc = gpu
    c_params, c_ema, c_loss, c_acc = cpu
    for p in g_params:
        assert np.array_equal(p, g_params[0])  # replicas bit-identical on the GPU too
    rel = np.linalg.norm(g_params[0] - c_params[0]) / np.linalg.norm(c_params[0])
    assert rel < tol, rel
    assert np.linalg.norm(g_ema - c_ema) / np.linalg.norm(c_ema) < tol
    assert abs(np.mean(g_loss) - np.mean(c_loss)) < 1e-3
    assert abs(g_acc - c_acc) < 0.02


def test_one_tower_on_one_gpu_matches_cpu():
    close_to_cpu(train(1, "0"), train(1, "cpu"))


def test_two_towers_sharing_one_gpu_match_cpu():
    p = resolve(2, "0")
    assert [str(d) for d in p.towers] == ["gpu:0", "gpu:0"] and "share" in p.notice
    close_to_cpu(train(2, "0"), train(2, "cpu"))


@pytest.mark.skipif(cuda_count() < 2, reason="needs at least 2 GPUs")
def test_n_towers_on_n_gpus_match_cpu():
    n = cuda_count()
    devices = ",".join(str(i) for i in range(n))
    close_to_cpu(train(n, devices), train(n, "cpu"))


def test_real_nccl_single_rank_all_reduce_is_a_copy():
    import cupy
    from towers.parallel.allreduce import NcclAllReduce

    with cupy.cuda.Device(0):
        stream = cupy.cuda.Stream(non_blocking=True)
        buf = cupy.arange(1000, dtype=cupy.float32)
        nar = NcclAllReduce([0])
        nar.average([buf], [stream.ptr])
        stream.synchronize()
        assert bool((buf == cupy.arange(1000, dtype=cupy.float32)).all())
        nar.close()


def test_cli_on_gpu(tmp_path):
    res = run_cli("--n-gpu", "2", "--steps", "300", "--log-placement", "--logdir", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "gpu:0" in res.stdout
    assert (tmp_path / "final.npz").exists()


def test_weights_mode_on_a_shared_gpu_matches_grads_mode():
    out = {}
    for sync in ("grads", "weights"):
        cfg = Config(n_gpu=2, devices="0", hidden=64, batch_size=60, sync=sync)
        ds = load_dataset(str(DIGITS))
        tr = Trainer(cfg, dataset=ds)
        src = BatchSource(ds, 120, cfg.seed)
        for _ in range(10):
            tr.train_step(*src.next_batch())
        tr.finish()
        assert tr.check_replicas()
        out[sync] = tr.replicas[0].params.get()
        tr.close()
    assert np.linalg.norm(out["weights"] - out["grads"]) / np.linalg.norm(out["grads"]) < 1e-5


def test_resume_on_gpu_continues_the_same_run(tmp_path):
    common = ["--n-gpu", "2", "--hidden", "64", "--momentum", "0.9", "--quiet", "--log-every", "10"]
    assert run_cli(*common, "--steps", "40", "--logdir", str(tmp_path / "a")).returncode == 0
    assert run_cli(*common, "--steps", "20", "--logdir", str(tmp_path / "b")).returncode == 0
    res = run_cli(*common, "--steps", "40", "--resume", "--logdir", str(tmp_path / "b"))
    assert res.returncode == 0, res.stderr
    with np.load(tmp_path / "a" / "final.npz") as a, np.load(tmp_path / "b" / "final.npz") as b:
        for k in a.files:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)
    ev = run_cli("--logdir", str(tmp_path / "b"), module="towers.eval")
    assert ev.returncode == 0 and "accuracy = " in ev.stdout, ev.stderr
