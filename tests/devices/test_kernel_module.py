"""The one CUDA module of towers' kernels (``towers.devices.kernels``), read without a GPU.

Its text is assembled from the parts other modules register (the layers') and
the devices' own kernels; these tests check that text and the registry's rules.
The kernels' arithmetic is checked on a GPU, in ``tests/gpu/test_gpu.py``.
"""
import re

import pytest

import towers  # noqa: F401 - importing towers registers the layers' kernels
from towers.devices import kernels


def test_the_module_defines_every_kernel_once_the_layers_first():
    text = kernels.source()
    defined = re.findall(r"__global__ void towers_(\w+)\(", text)
    assert sorted(defined) == sorted(kernels.kernel_names()) and len(set(defined)) == len(defined)
    assert defined[:2] == ["bias_add", "relu"] and defined[-5:] == ["mean2", "round_bf16", "round_fp16", "gather_u8",
                                                                    "gather_f32"]
    # One extern "C" block, after the helpers every part uses.
    assert text.count('extern "C" {') == 1 and text.index("np_max(float a") < text.index('extern "C" {')
    assert text.rstrip().endswith('}  // extern "C"')


def test_a_part_registered_after_the_compile_is_refused(monkeypatch):
    monkeypatch.setattr(kernels, "_PARTS", list(kernels._PARTS))
    part = "__global__ void towers_late(float* y, int n) { LOOP(i, n) y[i] = 0.f; }\n\n"
    kernels.register(kernels._PARTS[0][0], kernels._PARTS[0][1])  # the same part again: nothing changes
    assert kernels.source().count("towers_bias_add(") == 1
    monkeypatch.setattr(kernels, "_FROZEN", [kernels.source()])  # as after the first compile
    with pytest.raises(RuntimeError, match="late registered after the module was compiled"):
        kernels.register(part, ("late",))
    assert "towers_late" not in kernels.source()
