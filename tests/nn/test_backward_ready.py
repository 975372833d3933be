"""A replica's backward reports each layer's gradients once they are final (``ready``), in backward order."""
import numpy as np
import pytest

from towers.nn.layers import Dense, Flatten, ReLU, Sequential
from towers.nn.replica import Replica


def replica(precision):
    model = Sequential([Flatten(), Dense("a", 12), ReLU(), Dense("b", 10), ReLU(), Dense("c", 10)]).build((8, 8))
    r = Replica(model, np, precision=precision)
    r.set_params(model.init_params(3))
    return r


def batches(k):
    rng = np.random.default_rng(7)
    return [(rng.random((6, 8, 8), np.float32), rng.integers(0, 10, 6).astype(np.int32)) for _ in range(k)]


@pytest.mark.parametrize("precision, count", [("fp32", 1), ("bf16", 3)])
def test_each_layer_is_reported_once_its_gradients_are_final(precision, count):
    ref, r = replica(precision), replica(precision)
    args = dict(count=count, l2=1e-3, want_loss=False, loss_scale=4.0)
    ref.mean_loss_and_grads(batches(count), **args)
    spans = r.model.layer_spans()
    seen = []

    def ready(layer):
        # The layer's ranges as they are now, and the whole buffer.
        seen.append((layer, [r.grads[lo:hi].copy() for lo, hi in spans[layer]], r.grads.copy()))

    r.mean_loss_and_grads(batches(count), ready=ready, **args)
    assert np.array_equal(r.grads, ref.grads)  # finished layer by layer: the same bits as over the whole buffer
    # Every layer from the last to the first with parameters, once: only the last micro-batch reports.
    assert [layer for layer, *_ in seen] == [5, 4, 3, 2, 1]
    for layer, ranges, _ in seen:
        for (lo, hi), then in zip(spans[layer], ranges):
            assert np.array_equal(then, ref.grads[lo:hi]), layer  # final when reported
    # Reported during backward: when the last layer is reported, the first one's gradient is not final yet.
    _, _, early = seen[0]
    lo, hi = spans[1][0]
    assert not np.array_equal(early[lo:hi], ref.grads[lo:hi])
