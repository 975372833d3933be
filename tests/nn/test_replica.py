"""A replica's evaluation and prediction in chunks sized by bytes, not by a count of examples alone."""
from __future__ import annotations

import numpy
import pytest

from towers.nn import replica as replica_module
from towers.nn.models import build_model
from towers.nn.replica import Replica


@pytest.mark.parametrize("budget, sizes", [(3 * 4 * 48, [3, 3, 3, 1]), (1, [1] * 10)])
def test_evaluation_chunks_hold_at_most_a_budget_of_float32_examples(monkeypatch, budget, sizes):
    # Before: chunks of `batch` (250) examples whatever their size: 100 test images of 1024x1024x3 became one
    # 1.17 GiB float32 array, and a run that had streamed its training under a memory limit ended at its final
    # evaluation with a MemoryError.  Here the budget is scaled down to 4x4x3 examples (192 bytes as float32).
    model = build_model("mlp", (4, 4, 3), 5, hidden=8)
    r = Replica(model, numpy)
    r.set_params(model.init_params(0))
    rng = numpy.random.default_rng(0)
    x, y = rng.integers(0, 256, (10, 4, 4, 3), numpy.uint8), rng.integers(0, 5, 10)
    whole_loss, whole_accuracy = r.evaluate(x, y)
    whole = r.predict(x)
    monkeypatch.setattr(replica_module, "EVAL_CHUNK_BYTES", budget)
    seen = []
    loss, accuracy = r.evaluate(x, y, progress=seen.append)
    assert seen == sizes
    assert accuracy == whole_accuracy and loss == pytest.approx(whole_loss, rel=1e-6)
    numpy.testing.assert_allclose(r.predict(x), whole, rtol=1e-6, atol=1e-7)
