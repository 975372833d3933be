"""GPU runs compared with the CPU run of the same seed (skipped without CUDA).

CuPy's PerformanceWarning (an array used on the wrong device, i.e. hidden peer
access) is an error here.
"""
import numpy as np
import pytest

from tests.conftest import DIGITS, cuda_count, cupy_performance_warnings_fail, run_cli
from tests.ops.test_update_forms import VARIANTS as UPDATE_VARIANTS
from towers.arrays import to_host
from towers.data.batches import BatchSource
from towers.data.loading import load_dataset
from towers.devices.placement import resolve
from towers import Config, Trainer

pytestmark = [pytest.mark.gpu, *cupy_performance_warnings_fail()]


def train(n, devices, steps=20, momentum=0.9, **settings):
    cfg = Config(n_gpu=n, devices=devices, hidden=64, batch_size=60, momentum=momentum, **settings)
    ds = load_dataset(str(DIGITS))
    tr = Trainer(cfg, dataset=ds)
    src = BatchSource(ds, cfg.batch_size * n, cfg.seed)
    losses = []
    for step in range(steps):
        out = tr.train_step(*src.next_batch(), want_loss=step == steps - 1)
    losses = [float(v) for v in out]
    tr.synchronize()
    params = [to_host(r.params) for r in tr.executor.replicas]
    ema = to_host(tr.executor.ema.shadow)
    acc = tr.evaluate(ema=True)["accuracy"]
    tr.close()
    return params, ema, losses, acc


def close_to_cpu(gpu, cpu, tol=1e-4, loss_tol=1e-3):
    g_params, g_ema, g_loss, g_acc = gpu
    c_params, c_ema, c_loss, c_acc = cpu
    for p in g_params:
        assert np.array_equal(p, g_params[0])  # replicas bit-identical on the GPU too
    rel = np.linalg.norm(g_params[0] - c_params[0]) / np.linalg.norm(c_params[0])
    assert rel < tol, rel
    assert np.linalg.norm(g_ema - c_ema) / np.linalg.norm(c_ema) < tol
    assert abs(np.mean(g_loss) - np.mean(c_loss)) < loss_tol
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
        out[sync] = tr.executor.replicas[0].params.get()
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


# -- the ops' kernels (towers.ops, towers.devices.kernels) against their NumPy forms


def _ws(xp):
    from towers.nn.layers import Workspace

    return Workspace(xp)


def _both(fn, *host_arrays):
    """Run ``fn(xp, *arrays)`` on NumPy and on CuPy copies; return both results as host arrays."""
    import cupy

    outs = []
    for xp in (np, cupy):
        arrs = [xp.asarray(a.copy()) for a in host_arrays]
        res = fn(xp, *arrs)
        outs.append([to_host(r) for r in (res if isinstance(res, (list, tuple)) else [res])])
    return outs


def _assert_same_values(cpu, gpu):
    for c, g in zip(cpu, gpu):
        assert c.shape == g.shape and c.dtype == g.dtype
        nan = np.isnan(c)
        np.testing.assert_array_equal(nan, np.isnan(g))  # NaN where NumPy has NaN (its payload may differ)
        # Equal values; a zero's sign may differ (NVRTC turns selects into max instructions).
        np.testing.assert_array_equal(np.where(nan, 0, c), np.where(nan, 0, g))


def _floats(rng, shape, special=True):
    a = rng.standard_normal(shape).astype(np.float32)
    if special:  # ties, zeros of both signs and a NaN: the kernels must treat them as NumPy does
        flat = a.reshape(-1)
        flat[::7] = 0.0
        flat[3::11] = -0.0
        flat[5::13] = flat[4::13][: len(flat[5::13])]
        flat[17] = np.nan
    return a


def test_elementwise_kernels_give_numpys_bits():
    from towers.ops import activation, bias as bias_op, l2 as l2_op, mean2 as mean2_op

    rng = np.random.default_rng(1)
    x, b = _floats(rng, (37, 53)), _floats(rng, (53,), special=False)
    dy, w = _floats(rng, (37, 53)), _floats(rng, (37, 53))

    def bias(xp, y, b):
        bias_op.bias_add(y, b)
        return y

    def relu(xp, x):
        y = xp.full_like(x, 7.0)  # poisoned: every element must be written
        activation.relu(x, y)
        return y

    def add_relu(xp, h, s):
        y = xp.full_like(h, 7.0)
        activation.add_relu(h, s, y)
        return y

    def relu_bwd(xp, y, dy):
        activation.relu_backward(y, dy)
        return dy

    def l2(xp, g, w):
        l2_op.add_scaled(g, w, 1e-4)
        return g

    def mean2(xp, a, b):
        mean2_op.mean2(a, b, 0.5)
        return a, b

    for fn, args in ((bias, (x, b)), (relu, (x,)), (add_relu, (x, dy)), (relu_bwd, (x, dy)), (l2, (dy, w)),
                     (mean2, (x, dy))):
        cpu, gpu = _both(fn, *args)
        _assert_same_values(cpu, gpu)


@pytest.mark.parametrize("padding,shape", [("SAME", (3, 9, 11, 4)), ("VALID", (2, 8, 7, 3)), ("SAME", (2, 6, 6, 1))])
def test_im2col_and_col2im_kernels_give_numpys_bits(padding, shape):
    from towers.nn.conv import Conv2D
    from towers.ops import im2col as kernels

    conv = Conv2D("c", 5, 3 if padding == "VALID" else 5, padding)
    conv.build(shape[1:])
    k, (ho, wo) = conv.k, conv.out_hw
    n, h, w, c = shape
    rng = np.random.default_rng(2)
    x = _floats(rng, shape, special=False)
    dcols = _floats(rng, (n, ho, wo, k, k, c), special=False)

    def fwd(xp, x):
        cols = xp.full((n, ho, wo, k, k, c), 7.0, dtype=np.float32)
        kernels.im2col(x, cols, conv.pad, _ws(xp))
        return cols

    def bwd(xp, dcols):
        return kernels.col2im(dcols, (h, w), conv.pad, _ws(xp)).copy()

    for fn, a in ((fwd, x), (bwd, dcols)):
        cpu, gpu = _both(fn, a)
        _assert_same_values(cpu, gpu)


@pytest.mark.parametrize("shape", [(3, 8, 10, 4), (2, 7, 9, 3)])  # even, and odd (TF SAME padding)
def test_maxpool_kernels_give_numpys_bits(shape):
    from towers.ops import maxpool as kernels

    n, h, w, c = shape
    ho, wo = -(-h // 2), -(-w // 2)
    rng = np.random.default_rng(3)
    x = np.maximum(_floats(rng, shape), 0)  # after a ReLU: many tied zeros
    x.reshape(-1)[17] = np.nan
    dy = _floats(rng, (n, ho, wo, c), special=False)

    def pool(xp, x, dy):
        y = xp.full((n, ho, wo, c), 7.0, dtype=np.float32)
        ws = _ws(xp)
        kernels.maxpool(x, y, 2, ws)
        return y, kernels.maxpool_backward(x, y, dy, 2, ws).copy()

    cpu, gpu = _both(pool, x, dy)
    _assert_same_values(cpu, gpu)


def test_softmax_xent_kernel_matches_numpy():
    from towers.ops import softmax_xent as kernels

    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((64, 10)) * 30).astype(np.float32)  # large: the shift matters
    labels = rng.integers(0, 10, 64)

    def xent(xp, logits, labels):
        loss, d = kernels.softmax_xent(logits, labels, _ws(xp), True)
        return xp.asarray(loss).reshape(1), d

    (c_loss, c_d), (g_loss, g_d) = _both(xent, logits, labels)
    np.testing.assert_allclose(g_loss, c_loss, rtol=1e-5)
    np.testing.assert_allclose(g_d, c_d, rtol=1e-4, atol=1e-7)
    assert np.isfinite(g_d).all()


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_through_cublas_matches_numpy(trans_a, trans_b):
    import cupy
    from towers.ops import gemm as kernels

    rng = np.random.default_rng(4)
    m, k, n = 37, 53, 29
    a = _floats(rng, (k, m) if trans_a else (m, k), special=False)
    b = _floats(rng, (n, k) if trans_b else (k, n), special=False)
    expect = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    out = cupy.full((m, n), 7.0, dtype=cupy.float32)  # poisoned: every element must be written
    kernels.gemm(cupy.asarray(a), cupy.asarray(b), out, trans_a, trans_b)
    np.testing.assert_allclose(out.get(), expect, rtol=1e-5, atol=1e-5)
    # A strided operand is not what cuBLAS is given a pointer to: cupy.matmul takes it, same values.
    wide = cupy.asarray(np.concatenate([a, a], axis=1))[:, : a.shape[1]]
    out2 = cupy.full((m, n), 7.0, dtype=cupy.float32)
    kernels.gemm(wide, cupy.asarray(b), out2, trans_a, trans_b)
    np.testing.assert_allclose(out2.get(), expect, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gemm"):
        kernels.gemm(cupy.asarray(a), cupy.asarray(b), cupy.empty((m + 1, n), cupy.float32), trans_a, trans_b)


def test_bias_grad_on_gpu_is_the_column_sum():
    import cupy
    from towers.ops import bias as kernels

    dy = _floats(np.random.default_rng(8), (300, 41), special=False)
    out = cupy.full(41, 7.0, dtype=cupy.float32)
    kernels.bias_grad(cupy.asarray(dy), out, _ws(cupy))
    np.testing.assert_allclose(out.get(), dy.astype(np.float64).sum(axis=0), rtol=1e-5, atol=1e-5)


def test_gather_kernel_gives_the_staged_batch():
    import cupy
    from towers.devices import kernels

    rng = np.random.default_rng(5)
    xd = rng.integers(0, 256, (50, 6, 7), dtype=np.uint8)
    yd = rng.integers(0, 10, 50).astype(np.int32)
    idx = rng.permutation(50)[:17].astype(np.int64)
    scale = np.float32(1 / 255)
    xo, yo = cupy.full((17, 6, 7), 7.0, dtype=cupy.float32), cupy.full(17, -1, dtype=cupy.int32)
    kernels.gather_batch(cupy.asarray(xd), cupy.asarray(yd), cupy.asarray(idx), xo, yo, scale)
    expect = np.empty((17, 6, 7), np.float32)
    np.multiply(xd[idx], scale, out=expect, casting="unsafe")  # what the CPU Stager computes
    _assert_same_values([expect, yd[idx]], [xo.get(), yo.get()])


def test_device_resident_data_gives_the_host_pipelines_run():
    """train_step_at (batches gathered on the GPU) and train_step (host batches staged) agree bit for bit."""
    out = []
    for on_device in (True, False):
        cfg = Config(n_gpu=2, devices="0", hidden=64, batch_size=60, momentum=0.9)
        ds = load_dataset(str(DIGITS))
        with Trainer(cfg, dataset=ds) as tr:
            assert tr.executor.device_data is not None  # the digits fit
            src = BatchSource(ds, 120, cfg.seed)
            for _ in range(15):
                idx = src.next_indices()
                if on_device:
                    tr.train_step_at(idx)
                else:
                    tr.train_step(ds.x[idx], ds.y[idx])
            out.append(tr.get_weights())
    for name in out[0]:
        np.testing.assert_array_equal(out[0][name], out[1][name])


def test_lenet5_on_gpu_matches_cpu():
    rng = np.random.default_rng(6)
    x = rng.integers(0, 256, (240, 28, 28), dtype=np.uint8)
    y = rng.integers(0, 10, 240)
    from towers import Dataset

    res = {}
    for devices in ("0", "cpu"):
        cfg = Config(n_gpu=2, devices=devices, model="lenet5", batch_size=20, optimizer="sgd", lr=0.01,
                     momentum=0.9)
        with Trainer(cfg, dataset=Dataset.from_arrays(x, y)) as tr:
            src = BatchSource(tr.dataset, 40, cfg.seed)
            for _ in range(5):
                tr.train_step_at(src.next_indices())
            res[devices] = np.concatenate([v.ravel() for v in tr.get_weights().values()])
    rel = np.linalg.norm(res["0"] - res["cpu"]) / np.linalg.norm(res["cpu"])
    assert rel < 1e-4, rel


def test_tf32_is_opt_in_and_restored():
    from cupy._core import _routines_linalg as linalg

    before = linalg.get_compute_type(np.float32)
    cfg = Config(n_gpu=1, devices="0", hidden=64, batch_size=60, tf32=True)
    ds = load_dataset(str(DIGITS))
    with Trainer(cfg, dataset=ds) as tr:
        assert linalg.get_compute_type(np.float32) == linalg.COMPUTE_TYPE_TF32
        src = BatchSource(ds, 60, cfg.seed)
        for _ in range(5):
            loss = tr.train_step_at(src.next_indices(), want_loss=True)
        assert np.isfinite(float(loss[0]))
    assert linalg.get_compute_type(np.float32) == before


@pytest.mark.parametrize("ema", [True, False])
@pytest.mark.parametrize("variant", list(UPDATE_VARIANTS))
def test_each_optimizers_fused_kernel_gives_its_numpy_updates_bits(variant, ema):
    """Every optimizer of the registry in each variant (``tests/ops/test_update_forms.py``, which covers the
    registry): the one-kernel GPU update (with the EMA fused, or without) gives the bits of the CPU's NumPy
    passes (both derived from its one definition, ``towers.ops.codegen.cuda_form``: no FMA contraction, the same
    order)."""
    import cupy

    from towers.optim.ema import EMA
    from towers.optim.optimizers import OPTIMIZERS

    rng = np.random.default_rng(2)
    p0, grads = rng.normal(size=1000).astype(np.float32), rng.normal(size=(6, 1000)).astype(np.float32)
    grads[:, ::97] *= 1e-3  # small and large gradients: rounding differences would show
    results = []
    for xp in (np, cupy):
        p = xp.array(p0)  # a copy: the CPU's update must not move the GPU's start
        shadow = EMA(p, 0.99) if ema else None
        opt = OPTIMIZERS[variant.split("-")[0]](p, ema=shadow, **UPDATE_VARIANTS[variant])
        for step, g in enumerate(grads):
            opt.step(xp.asarray(g), 0.01 * (1 + step % 3), step)
        results.append((to_host(p), to_host(shadow.shadow) if ema else None,
                        {k: to_host(v) for k, v in opt.state.items()}))
    (cp, ce, cs), (gp, ge, gs) = results
    np.testing.assert_array_equal(gp, cp)
    if ema:
        np.testing.assert_array_equal(ge, ce)
    for k in cs:
        np.testing.assert_array_equal(gs[k], cs[k])


def test_the_standalone_ema_kernel_gives_numpys_bits():
    """Weights mode's EMA pass (``EMA.update``) on the GPU against its NumPy pass."""
    import cupy

    from towers.optim.ema import EMA

    rng = np.random.default_rng(3)
    p0, targets = rng.normal(size=777).astype(np.float32), rng.normal(size=(5, 777)).astype(np.float32)
    out = []
    for xp in (np, cupy):
        ema = EMA(xp.array(p0), 0.99)
        for k, t in enumerate(targets):
            ema.update(xp.asarray(t), k)
        out.append(to_host(ema.shadow))
    np.testing.assert_array_equal(out[1], out[0])


def test_kernels_give_other_dtypes_to_cupys_array_operations():
    """A float64 device array (a user's layer computing in float64) is not read as float32 by a raw kernel."""
    import cupy

    from towers.devices import kernels as device_kernels
    from towers.ops import activation, bias, l2, mean2

    rng = np.random.default_rng(9)
    x = rng.standard_normal((13, 7))
    y = cupy.empty((13, 7), dtype=cupy.float64)
    activation.relu(cupy.asarray(x), y)
    np.testing.assert_array_equal(y.get(), np.maximum(x, 0))
    g, w = cupy.asarray(x), cupy.asarray(x[::-1].copy())
    l2.add_scaled(g, w, 0.5)
    np.testing.assert_allclose(g.get(), x + 0.5 * x[::-1], rtol=1e-15)
    b = rng.standard_normal(7)
    yb = cupy.asarray(x)
    bias.bias_add(yb, cupy.asarray(b))
    np.testing.assert_array_equal(yb.get(), x + b)
    a1, a2 = cupy.asarray(x), cupy.asarray(2 * x)
    mean2.mean2(a1, a2, 0.5)
    np.testing.assert_allclose(a1.get(), 1.5 * x, rtol=1e-15)
    assert device_kernels.takes(cupy.empty(3, cupy.float32)) and not device_kernels.takes(cupy.empty(3, cupy.float64))


def test_an_update_of_buffers_of_another_dtype_takes_cupys_passes():
    """float64 device buffers are not read as float32 by the update's kernel: CuPy runs the update's passes, which
    agree with NumPy's float64 to float64 rounding (CuPy's compiled passes may contract a product and a sum to one
    FMA: 2 of 10 elements 1 ulp apart on an H200, 1e-14 relative)."""
    import cupy

    from towers.optim.optimizers.adam import Adam

    out = []
    for xp in (np, cupy):
        opt = Adam(xp.linspace(-1, 1, 10))
        opt.step(xp.linspace(1, 2, 10), 0.1, 0)
        out.append(to_host(opt.params))
    assert out[0].dtype == out[1].dtype == np.float64
    np.testing.assert_allclose(out[1], out[0], rtol=1e-13)  # read as float32, they would be off by 1e-7 or garbage


# -- low precision (--precision, --allreduce-dtype): the rounding in float32 buffers, run on an H200 -----------


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_precision_rounding_kernels_give_numpys_bits(precision):
    """The CUDA kernel of ``round_to`` and CuPy's run of its array passes round as the NumPy form does (NaN: a
    NaN), on special values (zeros, NaN payloads, infinities, subnormals, ties, overflow) and random bits."""
    import cupy

    from tests.optim.test_precision import same_rounding, special_bits
    from towers.ops.precision import round_bf16, round_to

    x = special_bits().view(np.float32)
    want = x.copy()
    round_to(want, precision)  # the NumPy form
    on_device = cupy.asarray(x)
    round_to(on_device, precision)  # the kernel (float32, contiguous)
    same_rounding(to_host(on_device), want)
    strided = cupy.asarray(x)[::2]  # not contiguous: CuPy runs the array passes
    round_to(strided, precision)
    same_rounding(to_host(strided), want[::2])
    if precision == "bf16":
        passes = cupy.asarray(x)
        round_bf16(cupy, passes)
        same_rounding(to_host(passes), want)


@pytest.mark.parametrize("settings", [dict(precision="bf16"), dict(precision="fp16"), dict(allreduce_dtype="bf16"),
                                      dict(precision="bf16", allreduce_dtype="bf16")])
def test_low_precision_on_a_shared_gpu_stays_close_to_the_cpu(settings):
    """Two towers sharing the GPU in low precision: replicas bit-identical, close to the CPU's run of the same
    rounding (cuBLAS sums in another order, and a value that lands on the other side of a bf16 rounding boundary
    moves by a bf16 ulp, so the tolerance is bf16's, not float32's: on an H200 the mean loss of fp16 was 0.010 off
    the CPU's and that of a bf16 all-reduce 0.016, of about 0.7, with the weights within 2e-2)."""
    close_to_cpu(train(2, "0", **settings), train(2, "cpu", **settings), tol=2e-2, loss_tol=3e-2)
