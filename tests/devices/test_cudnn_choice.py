"""The ``gpu_conv`` choice on a machine without cuDNN or without a GPU: a clear error or im2col, never a crash.

Whether cuDNN's convolutions are right is checked on a GPU (``tests/gpu/test_gpu_cudnn.py``).
"""
from __future__ import annotations

import pytest

from towers import Config, Trainer
from towers.devices import cudnn
from towers.devices.placement import CPU
from towers.errors import UserError
from towers.nn.models import build_model
from towers.ops import forms


def _gpu_started() -> bool:
    try:
        return cudnn.available() is None
    except Exception:  # noqa: BLE001 - no CuPy at all
        return False


@pytest.mark.skipif(_gpu_started(), reason="cuDNN starts here: the refusal is for machines where it does not")
def test_cudnn_asked_where_it_does_not_start_is_one_clear_error():
    model = build_model("lenet5", (28, 28, 1), 10)
    with pytest.raises(UserError, match=r"gpu_conv.? cudnn: .*(pip install nvidia-cudnn-frontend|does not start)"
                                         r".*set .?gpu_conv.? to auto or im2col"):
        forms.choose("numpy", model, True, "cudnn", gpu=CPU)
    assert not forms.choose("numpy", model, True, "auto", gpu=CPU).cudnn  # auto: im2col, no error


def test_an_unknown_gpu_conv_is_refused_by_name():
    with pytest.raises(UserError, match="gpu_conv"):
        Config(gpu_conv="winograd").resolved()


def test_cpu_towers_ignore_gpu_conv_and_train_as_without_it():
    """No GPU tower, nothing for cuDNN to run: the run is the im2col one, bit for bit."""
    from tests.gpu_compare import flat, images

    ds = images(48, (12, 12, 3))
    runs = []
    for form in ("cudnn", "im2col"):
        tr = Trainer(Config(devices="cpu", n_gpu=1, model="lenet5", batch_size=8, steps=2, quiet=True,
                            summary_every=0, gpu_conv=form), dataset=ds)
        try:
            tr.run_steps(2)
            assert not tr.executor.forms.cudnn
            runs.append(flat(tr.get_weights()))
        finally:
            tr.close()
    assert (runs[0] == runs[1]).all()
