"""towers.export: checkpoints to safetensors, loaded into PyTorch (and Keras where installed) and compared
with towers' own evaluation on the same inputs.

The runs are tiny (the digits, a few steps); what is compared is the function, so the weights need not
be good.  PyTorch and Keras are test-only references: skipped when absent.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from tests.conftest import DIGITS, REPO
from towers import Config, Dataset, Trainer
from towers.export import main as export_main
from towers.output.checkpoint import latest_checkpoint, list_checkpoints
from towers.train import main as train_main

# Its PyTorch and Keras tests, and the module's trained runs, in one worker (tests/conftest.py).
pytestmark = pytest.mark.references

RUN = ["--devices", "cpu", "--n-gpu", "2", "--batch-size", "20", "--quiet", "--summary-every", "0"]


@pytest.fixture(scope="module")
def digits():
    with np.load(DIGITS) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An MLP run and a LeNet-5 run on the digits: their logdirs."""
    out = {}
    for model, extra in (("mlp", ["--hidden", "32"]), ("lenet5", []), ("resnet20", [])):
        logdir = tmp_path_factory.mktemp(model)
        assert train_main([*RUN, "--model", model, *extra, "--steps", "6", "--logdir", str(logdir)]) == 0
        out[model] = logdir
    return out


def export(capsys, *args):
    status = export_main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.err.strip().splitlines()


def towers_reference(logdir, digits, ema):
    """towers' logits and Trainer.evaluate on the test digits with the run's newest checkpoint's weights."""
    path, arrays = latest_checkpoint(str(logdir))
    cfg = arrays["config"]
    ds = Dataset.from_arrays(digits["x"], digits["y"], digits["x_test"], digits["y_test"])
    with Trainer(Config(devices="cpu", n_gpu=1, model=cfg["model"], hidden=cfg["hidden"], batch_size=20),
                 dataset=ds) as tr:
        prefix = "ema/" if ema else "params/"
        named = {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}
        named.update({k[len("buffers/"):]: v for k, v in arrays.items() if k.startswith("buffers/")})
        tr.set_weights(named)
        metrics = tr.evaluate(ema=False)
        logits = tr.predict(digits["x_test"], ema=False)  # uint8 pixels, scaled by 1/255 as in training
    return logits, metrics


def torch_model(torch, name, hidden=32):
    nn = torch.nn
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10)), \
            ["layer1", "layer2"]
    return nn.Sequential(  # the book's LeNet-5 as towers builds it (each ReLU after its pool: the same function)
        nn.Conv2d(1, 32, 5, padding=2), nn.MaxPool2d(2, ceil_mode=True), nn.ReLU(),
        nn.Conv2d(32, 64, 5, padding=2), nn.MaxPool2d(2, ceil_mode=True), nn.ReLU(),
        nn.Flatten(), nn.Linear(2 * 2 * 64, 512), nn.ReLU(), nn.Linear(512, 10)), \
        ["layer1-conv1", "layer3-conv2", "layer5-fc1", "layer6-fc2"]


@pytest.mark.parametrize("model, ema", [("mlp", True), ("lenet5", False), ("lenet5", True)])
def test_torch_layout_loads_into_pytorch_and_predicts_as_towers_does(tmp_path, capsys, runs, digits, model, ema):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    checkpoint = list_checkpoints(str(runs[model]))[0][1]
    out = tmp_path / "w.safetensors"
    status, err = export(capsys, checkpoint, "-o", out, "--layout", "torch", *(["--ema"] if ema else []))
    assert status == 0, err
    tensors = load_file(str(out))
    net, scopes = torch_model(torch, model)
    modules = [m for m in net if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    state = {}
    for k, (scope, module) in enumerate(zip(scopes, modules)):
        index = list(net).index(module)
        state[f"{index}.weight"], state[f"{index}.bias"] = tensors[f"{scope}.weight"], tensors[f"{scope}.bias"]
    assert set(tensors) == {f"{s}.{p}" for s in scopes for p in ("weight", "bias")}
    net.load_state_dict(state)  # strict: every shape must be PyTorch's
    images = torch.from_numpy(digits["x_test"] * np.float32(1 / 255))
    with torch.no_grad():
        logits = net(images if model == "mlp" else images[:, None]).numpy()  # NCHW for the convolutions
    ours, metrics = towers_reference(runs[model], digits, ema)
    np.testing.assert_allclose(logits, ours, rtol=1e-4, atol=1e-5)
    y = torch.from_numpy(digits["y_test"].astype(np.int64))
    loss = float(torch.nn.functional.cross_entropy(torch.from_numpy(logits), y))
    accuracy = float((logits.argmax(1) == digits["y_test"]).mean())
    assert accuracy == metrics["accuracy"]
    assert loss == pytest.approx(metrics["loss"], rel=1e-5)


def resnet20_in_torch(torch, t, images):
    """He et al.'s resnet20 written with PyTorch's functions over the exported tensors ``t`` (NCHW images)."""
    F = torch.nn.functional

    def bn(x, scope):
        return F.batch_norm(x, t[f"{scope}.running_mean"], t[f"{scope}.running_var"], t[f"{scope}.weight"],
                            t[f"{scope}.bias"], training=False, eps=1e-3)

    x = F.relu(bn(F.conv2d(images, t["conv1.weight"], padding=1), "bn1"))
    for stage in (1, 2, 3):
        for block in (1, 2, 3):
            s = f"stage{stage}.block{block}"
            stride = 2 if stage > 1 and block == 1 else 1
            body = F.relu(bn(F.conv2d(x, t[f"{s}.conv1.weight"], stride=stride, padding=1), f"{s}.bn1"))
            body = bn(F.conv2d(body, t[f"{s}.conv2.weight"], padding=1), f"{s}.bn2")
            short = x[:, :, ::stride, ::stride]  # option A: zero channels appended
            short = F.pad(short, (0, 0, 0, 0, 0, body.shape[1] - short.shape[1]))
            x = F.relu(body + short)
    return F.linear(x.mean((2, 3)), t["fc.weight"], t["fc.bias"])


@pytest.mark.parametrize("ema", [False, True])
def test_a_batch_norm_resnet_exports_its_moving_statistics_and_predicts_in_pytorch(tmp_path, capsys, runs, digits,
                                                                                     ema):
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    out = tmp_path / "r.safetensors"
    status, err = export(capsys, list_checkpoints(str(runs["resnet20"]))[0][1], "-o", out, "--layout", "torch",
                         *(["--ema"] if ema else []))
    assert status == 0, err
    t = load_file(str(out))
    assert len([k for k in t if k.endswith("running_var")]) == 19  # every BatchNorm's moving statistics
    assert not np.allclose(t["bn1.running_mean"].numpy(), 0)  # trained statistics, not the initial ones
    with torch.no_grad():
        logits = resnet20_in_torch(torch, t, torch.from_numpy(digits["x_test"] * np.float32(1 / 255))[:, None])
    ours, metrics = towers_reference(runs["resnet20"], digits, ema)
    np.testing.assert_allclose(logits.numpy(), ours, rtol=1e-4, atol=1e-4)
    assert float((logits.numpy().argmax(1) == digits["y_test"]).mean()) == metrics["accuracy"]


def test_towers_layout_is_the_checkpoint_as_it_is_and_final_npz_exports_too(tmp_path, capsys, runs):
    from safetensors import safe_open

    logdir = runs["lenet5"]
    with np.load(logdir / "final.npz") as z:
        final = {k: z[k] for k in z.files}
    out = tmp_path / "raw.safetensors"
    assert export(capsys, logdir / "final.npz", "-o", out)[0] == 0
    with safe_open(str(out), "np") as f:
        assert set(f.keys()) == {k[len("params/"):] for k in final if k.startswith("params/")}
        for key in f.keys():
            np.testing.assert_array_equal(f.get_tensor(key), final["params/" + key])
        assert f.metadata()["towers.weights"] == "raw" and f.metadata()["towers.step"] == "6"
    # --layout torch from final.npz reads the model from the checkpoint of its step beside it...
    assert export(capsys, logdir / "final.npz", "-o", tmp_path / "t.safetensors", "--layout", "torch")[0] == 0
    # ... and says so when it is not there.
    alone = tmp_path / "alone" / "final.npz"
    alone.parent.mkdir()
    shutil.copy(logdir / "final.npz", alone)
    status, err = export(capsys, alone, "-o", tmp_path / "u.safetensors", "--layout", "torch")
    assert status == 2 and len(err) == 1 and "holds weights only" in err[0] and "--layout towers" in err[0], err
    assert not (tmp_path / "u.safetensors").exists()


def test_keras_loads_the_towers_layout(tmp_path, capsys, runs, digits):
    keras = pytest.importorskip("keras")
    from safetensors.numpy import load_file

    out = tmp_path / "k.safetensors"
    assert export(capsys, list_checkpoints(str(runs["mlp"]))[0][1], "-o", out, "--ema")[0] == 0
    w = load_file(str(out))
    net = keras.Sequential([keras.Input(shape=(8, 8)), keras.layers.Flatten(),
                            keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)])
    net.layers[1].set_weights([w["layer1/weights"], w["layer1/biases"]])
    net.layers[2].set_weights([w["layer2/weights"], w["layer2/biases"]])
    # convert_to_numpy: under KERAS_BACKEND=torch the output is a tensor that requires grad (np.asarray refuses it)
    logits = keras.ops.convert_to_numpy(net(digits["x_test"] * np.float32(1 / 255)))
    np.testing.assert_allclose(logits, towers_reference(runs["mlp"], digits, True)[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", ["missing", "directory", "not npz", "not a checkpoint", "output exists",
                                  "no such folder", "a file for a folder", "read-only folder", "output a folder"])
def test_bad_input_is_one_line_exit_2_and_no_file(tmp_path, capsys, runs, case):
    checkpoint = list_checkpoints(str(runs["mlp"]))[0][1]
    out = tmp_path / "out" / "w.safetensors"
    out.parent.mkdir()
    source, expected = checkpoint, None
    if case == "missing":
        source, expected = tmp_path / "nope.npz", "does not exist: give a checkpoint"
    elif case == "directory":
        source, expected = runs["mlp"], "is a directory"
    elif case == "not npz":
        source = tmp_path / "notes.txt"
        source.write_text("hello\n")
        expected = "is not a readable npz file"
    elif case == "not a checkpoint":
        source, expected = DIGITS, "is not a towers checkpoint or final.npz (no params/* weights and step; keys: x, "
    elif case == "output exists":
        out.write_bytes(b"keep me")
        expected = "exists: export writes no file over another"
    elif case == "no such folder":
        out, expected = tmp_path / "no" / "w.safetensors", "does not exist; choose another -o"
    elif case == "a file for a folder":
        (tmp_path / "file").write_text("")
        out, expected = tmp_path / "file" / "w.safetensors", "file is a file, not a folder; choose another -o"
    elif case == "output a folder":  # before: "for example OUT/out.npz", a name for another kind of file
        out = out.parent
        expected = f"-o {out} is a directory: give a file path, for example {out / 'model.safetensors'}"
    elif case == "read-only folder":
        if os.geteuid() == 0:
            pytest.skip("root writes into a read-only folder")
        out.parent.chmod(0o500)
        expected = "cannot write"
    status, err = export(capsys, source, "-o", out, "--layout", "torch")
    assert status == 2 and len(err) == 1 and err[0].startswith("towers.export: error: ") and expected in err[0], err
    if case == "output exists":
        assert out.read_bytes() == b"keep me"
    elif case == "output a folder":
        assert os.listdir(out) == []
        return
    else:
        assert not out.exists()
    if out.parent.is_dir():
        assert [p for p in os.listdir(out.parent) if p != "w.safetensors"] == []  # no temporary left


def test_an_empty_output_is_refused_before_anything_is_read(tmp_path, capsys, monkeypatch):
    # Before: "cannot write : No such file or directory [ENOENT]: choose another -o, or make <parent of the
    # current folder> writable".
    monkeypatch.chdir(tmp_path)
    status, err = export(capsys, tmp_path / "ckpt-00000006.npz", "-o", "")
    assert status == 2 and err == ["towers.export: error: -o is empty: give the output file's path"], err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("layout, ema", [("towers", False), ("towers", True), ("torch", False)])
def test_non_finite_weights_are_refused_as_eval_and_resume_refuse_them(tmp_path, capsys, runs, layout, ema):
    with np.load(list_checkpoints(str(runs["mlp"]))[0][1]) as z:
        arrays = {k: z[k] for k in z.files}
    arrays[("ema/" if ema else "params/") + "layer2/biases"][3] = np.nan
    source, out = tmp_path / "ckpt-00000006.npz", tmp_path / "w.safetensors"
    np.savez(source, **arrays)
    status, err = export(capsys, source, "-o", out, "--layout", layout, *(["--ema"] if ema else []))
    assert status == 2 and len(err) == 1 and err[0].startswith("towers.export: error: "), err
    assert "'layer2/biases' holds NaN or inf" in err[0], err
    assert not out.exists()


def test_a_failed_write_is_one_line_exit_1_and_no_file(tmp_path, runs):
    """A file-size limit makes the write fail as a full disk would (EFBIG instead of ENOSPC).

    Before: safetensors' own error type escaped as a traceback.
    """
    import resource
    import signal
    import subprocess
    import sys

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    out = tmp_path / "out" / "w.safetensors"
    out.parent.mkdir()
    p = subprocess.run([sys.executable, "-m", "towers.export", list_checkpoints(str(runs["lenet5"]))[0][1], "-o",
                        str(out)], capture_output=True, text=True, preexec_fn=limit, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    err = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(err) == 1, p.stderr
    assert err[0].startswith(f"towers.export: error: cannot write {out}: File too large"), err
    assert os.listdir(out.parent) == []


def in_own_tmpfs(mount_options: str, folder, *command: str) -> subprocess.CompletedProcess:
    """``command`` with ``folder`` a new tmpfs mounted ``mount_options``, in a user and mount namespace of its own
    (``unshare -rm``): a real read-only or full file system, without privileges and without touching this machine's
    mounts; skipped where the kernel or the sandbox allows no such namespace.  Its stdout ends with what the
    tmpfs holds after the command (``ls -A``), the exit status is the command's.

    A read-only folder made by chmod would not do: root (as in a container) writes through it.
    """
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    os.makedirs(folder, exist_ok=True)
    script = 'mount -t tmpfs -o "$1" tmpfs "$2" || exit 99; d="$2"; shift 2; "$@"; rc=$?; ls -A "$d"; exit $rc'
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", "size=64k", str(folder), "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"no user and mount namespaces here: {probe.stderr.strip()}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", mount_options, str(folder), *command],
                          capture_output=True, text=True, timeout=120, cwd=REPO)


@pytest.mark.parametrize("case", ["read-only", "full"])
def test_a_read_only_folder_is_exit_2_and_a_full_disk_exit_1_each_in_its_own_words(tmp_path, runs, case):
    """The real writer on a real read-only or full tmpfs.  Before: both exit 1, read-only told to free space,
    a full disk told to choose "another output folder" (the command's flag is -o)."""
    folder = tmp_path / "mnt"
    out = folder / "w.safetensors"
    checkpoint = list_checkpoints(str(runs["lenet5"]))[0][1]  # about 1.3 MB: more than the 64 KB disk
    options = "ro,size=1m" if case == "read-only" else "size=64k"
    p = in_own_tmpfs(options, folder, sys.executable, "-m", "towers.export", checkpoint, "-o", str(out),
                     "--layout", "torch")
    err = p.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"towers.export: error: cannot write {out}: "), p.stderr
    if case == "read-only":
        assert p.returncode == 2, p.stderr
        assert err[0].endswith(f"Read-only file system [EROFS]: choose another -o, or make {folder} writable"), err
    else:
        assert p.returncode == 1, p.stderr
        assert err[0].endswith(f"No space left on device [ENOSPC]; free some space in {folder} or choose another "
                               "-o"), err
    assert p.stdout.strip() == "", p.stdout  # nothing left on the tmpfs: no file, no temporary


def test_metadata_names_an_image_folders_classes(tmp_path, capsys):
    # Before: the metadata carried the class count (towers.classes) and not the names.
    import json

    from PIL import Image
    from safetensors import safe_open

    from towers import Config, Trainer

    rng = np.random.default_rng(0)
    for name in ("cat", "dog", "emu"):
        (tmp_path / "images" / name).mkdir(parents=True)
        for k in range(4):
            Image.fromarray(rng.integers(0, 256, (6, 6), dtype=np.uint8)).save(tmp_path / "images" / name / f"{k}.png")
    cfg = Config(n_gpu=1, devices="cpu", hidden=8, batch_size=4, steps=2, quiet=True, summary_every=0,
                 data=str(tmp_path / "images"), logdir=str(tmp_path / "run"))
    with Trainer(cfg) as tr:
        tr.fit()
    out = tmp_path / "m.safetensors"
    assert export(capsys, tmp_path / "run" / "ckpt-00000002.npz", "-o", out)[0] == 0
    with safe_open(str(out), "np") as f:
        assert f.metadata()["towers.classes"] == "3"
        assert json.loads(f.metadata()["towers.class_names"]) == ["cat", "dog", "emu"]


@pytest.mark.slow
def test_resnet50_exports_into_torchvisions_resnet50_strictly_and_gives_towers_logits():
    """ResNet-50's weights (random, the batch norms' statistics and affine parameters too) in the torch layout
    (``towers.export.convert``, what --layout torch writes, through safetensors' bytes): torchvision's own
    ``resnet50(num_classes=10)`` loads them strictly (every name and shape, ``num_batches_tracked`` too) and in
    eval mode computes towers' logits on 32x32 images.  (The command line's path, checkpoint to file, is the
    other tests'; a run of ResNet-50 would take the suite's time.)"""
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    from safetensors.numpy import save
    from safetensors.torch import load

    from towers.export import convert
    from towers.nn.models import build_model
    from towers.nn.replica import Replica

    model = build_model("resnet50", (32, 32, 3), 10)
    rng = np.random.default_rng(0)
    params, buffers = model.init_params(0), model.init_buffers()
    for name, _, off, size in model.layout():
        if name.endswith(("gamma", "beta")):
            params[off: off + size] = rng.uniform(0.5, 1.5, size) if name.endswith("gamma") else rng.normal(0, .1, size)
    for name, _, off, size in model.buffer_layout():
        buffers[off: off + size] = rng.normal(0, 0.1, size) if name.endswith("mean") else rng.uniform(0.5, 1.5, size)
    named = {n: flat[o: o + k].reshape(shape) for flat, layout in ((params, model.layout()),
                                                                  (buffers, model.buffer_layout()))
             for n, shape, o, k in layout}
    net = torchvision.models.resnet50(num_classes=10)
    net.load_state_dict(load(save(convert(model, named, "torch"))))  # strict
    net.eval()
    replica = Replica(model, np)
    replica.set_params(params)
    replica.set_buffers(buffers)
    x = rng.integers(0, 256, (3, 32, 32, 3)).astype(np.float32) / 255
    ours = np.asarray(replica.forward(x))
    with torch.no_grad():
        theirs = net(torch.from_numpy(x.transpose(0, 3, 1, 2).copy())).numpy()
    np.testing.assert_allclose(theirs, ours, rtol=1e-4, atol=1e-4)
