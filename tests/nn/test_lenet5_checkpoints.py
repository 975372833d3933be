"""LeNet-5 left the whole-batch convolution: checkpoints written before still resume.

Before, ``lenet5`` built its two convolutions with ``algorithm="whole"``
so that published runs kept their bits; it now takes the default (chunked)
algorithm, which is faster and sums in another order.  A checkpoint holds the
weights, buffers and optimizer state, whose layout does not depend on the
algorithm, so an old run resumes under the new code and continues where it was.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from tests import commands
from towers.nn.conv import Conv2D
from towers.nn.models import lenet5

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--model", "lenet5", "--n-gpu", "2", "--batch-size", "16", "--quiet", "--summary-every", "0",
          "--checkpoint-every", "5", "--log-every", "5"]
# The code before the change: every Conv2D of lenet5 built with algorithm="whole".
OLD = ("import sys\n"
       "from towers.nn import conv\n"
       "init = conv.Conv2D.__init__\n"
       "def whole(self, *a, **k):\n"
       "    k.setdefault('algorithm', 'whole')\n"
       "    init(self, *a, **k)\n"
       "conv.Conv2D.__init__ = whole\n"
       "from towers.train import main\n"
       "sys.exit(main(sys.argv[1:]))\n")


def _train(logdir, *args, old=False):
    args = ["--logdir", str(logdir), *COMMON, *map(str, args)]
    p = (subprocess.run([sys.executable, "-c", OLD, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
         if old else commands.run("towers.train", *args, cwd=ROOT, timeout=300))
    assert p.returncode == 0, p.stderr
    return p


def test_lenet5_uses_the_default_convolution_algorithm():
    convs = [layer for layer in lenet5((28, 28), 10).layers if isinstance(layer, Conv2D)]
    assert [c.algorithm for c in convs] == ["chunked", "chunked"]


@pytest.mark.slow
def test_a_checkpoint_of_the_whole_batch_lenet5_resumes_under_the_new_code(tmp_path):
    _train(tmp_path / "old", "--steps", 20, old=True)  # the old code, straight to step 20
    (tmp_path / "split").mkdir()  # the step 10 checkpoint the old code wrote on its way (it keeps 5)
    shutil.copy(tmp_path / "old" / "ckpt-00000010.npz", tmp_path / "split")
    p = _train(tmp_path / "split", "--steps", 20, "--resume")  # the new code resumes it
    assert "resuming from" in p.stdout and "ckpt-00000010.npz" in p.stdout
    _train(tmp_path / "fresh", "--steps", 10)  # the new code from scratch
    with numpy.load(tmp_path / "old" / "final.npz") as a, numpy.load(tmp_path / "split" / "final.npz") as b, \
            numpy.load(tmp_path / "fresh" / "final.npz") as c:
        assert int(b["step"]) == 20
        names = [k for k in a.files if "/" in k]
        assert names and sorted(names) == sorted(k for k in b.files if "/" in k)
        for k in names:
            # The same sums in another order: 10 Adam steps later, close to the old code's own run
            # (Adam's step is at most lr = 1e-3 per weight and step), and nowhere near a fresh start.
            numpy.testing.assert_allclose(b[k], a[k], rtol=0, atol=5e-3, err_msg=k)
        assert max(float(numpy.abs(b[k] - c[k]).max()) for k in names) > 5e-3
