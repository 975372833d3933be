"""cuDNN's graph descriptions on a machine without a GPU, with the cuDNN frontend installed here.

From 1.32 the frontend describes a graph in Python, without a GPU or the cuDNN
library, up to the handle: every convolution of ResNet-20 and the CIFAR-10
model (forward, input gradient, weight gradient) is described here as a GPU run
describes it, so a frontend whose API moved is caught before a GPU is spent.
Whether the graphs build and compute right is checked on a GPU
(``tests/gpu/test_gpu_cudnn.py``, ``python -m tools.cudnn_probe``).
"""
from __future__ import annotations

import numpy
import pytest

from towers.devices import cudnn
from tools import cudnn_probe

fe = pytest.importorskip("cudnn", reason="the cuDNN frontend (nvidia-cudnn-frontend) is not installed")


def _describes_without_a_gpu() -> bool:
    try:
        fe.pygraph(io_data_type=fe.data_type.FLOAT, handle=None)
    except Exception:  # noqa: BLE001 - a pybind frontend (< 1.32) needs the cuDNN library for a graph
        return False
    return True


needs_python_graphs = pytest.mark.skipif(not _describes_without_a_gpu(),
                                         reason="this frontend needs the cuDNN library to describe a graph")


def test_the_models_convolutions_are_their_shapes():
    shapes = {m: cudnn_probe.conv_shapes(m, 128) for m in ("resnet20", "cifar10")}
    assert len(shapes["resnet20"]) == 6 and len(shapes["cifar10"]) == 2
    first = shapes["resnet20"][0]
    assert (first["x"], first["w"], first["y"], first["pre"], first["post"], first["stride"]) == (
        (128, 32, 32, 3), (16, 3, 3, 3), (128, 32, 32, 16), (1, 1), (1, 1), 1)
    halves = [s for s in shapes["resnet20"] if s["stride"] == 2]
    assert [s["y"][1:3] for s in halves] == [(16, 16), (8, 8)]
    assert sum(len(s["layers"]) for s in shapes["resnet20"]) == 19  # conv1 and 9 blocks of two
    five = shapes["cifar10"]
    assert [s["w"][1:3] for s in five] == [(5, 5), (5, 5)] and five[0]["pre"] == (2, 2)


@needs_python_graphs
def test_every_convolution_graph_of_resnet20_and_cifar10_is_described():
    rows = cudnn_probe.describe_all(["resnet20", "cifar10"], 128)
    assert len(rows) == (6 + 2) * 3
    failed = [f"{r['shape']} {r['op']}: {r['error']}" for r in rows if r["error"] is not None]
    assert not failed, failed


@needs_python_graphs
def test_a_description_has_the_operands_in_call_order():
    s = cudnn_probe.conv_shapes("cifar10", 8)[0]
    g = cudnn.describe("wgrad", s["x"], s["w"], s["y"], s["pre"], s["post"], 1, (16, 16, 16), numpy.float32)
    out = [t for t in g.get_outputs() if t.uid == 3]
    f, kh, kw, c = s["w"]
    assert out and list(out[0].dim) == [f, c, kh, kw] and list(out[0].stride) == [kh * kw * c, 1, kw * c, c]


def test_an_operand_the_frontend_cannot_describe_is_unsupported_not_a_crash():
    """A 4-byte aligned view, where the frontend has no byte alignment to declare, runs by im2col."""
    g = fe.pygraph(io_data_type=fe.data_type.FLOAT, handle=None) if _describes_without_a_gpu() else None
    if g is None or hasattr(g.tensor(name="t", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1]), "set_alignment"):
        pytest.skip("this frontend declares byte alignments: nothing to refuse")
    s = cudnn_probe.conv_shapes("resnet20", 8)[1]
    with pytest.raises(cudnn.Unsupported, match="4-byte aligned"):
        cudnn.describe("fprop", s["x"], s["w"], s["y"], s["pre"], s["post"], 1, (16, 4, 16), numpy.float32)


def test_a_graph_that_cannot_be_built_here_is_unsupported_with_its_reason():
    """No GPU here: the build fails at the handle, and that is an ``Unsupported`` naming why (the layer then runs
    im2col), never an exception of another type."""
    s = cudnn_probe.conv_shapes("resnet20", 8)[0]
    key = (0, "fprop", s["x"], s["w"], s["y"], s["pre"], s["post"], 1, "float32", False, (16, 16, 16), 0)
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a GPU is visible: the build would succeed")
    except Exception:  # noqa: BLE001 - no CuPy or no driver: the case under test
        pass
    with pytest.raises(cudnn.Unsupported, match=r"cuDNN fprop .*frontend"):
        cudnn._build(key, "fprop", s["x"], s["w"], s["y"], s["pre"], s["post"], 1, (16, 16, 16), numpy.float32)
