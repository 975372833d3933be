"""The gradient buckets' plan: layer ranges of the flat buffer, cut at layer boundaries from the last layer."""
import numpy as np
import pytest

from towers.nn.models import build_model
from towers.parallel.buckets import plan_buckets

MODELS = {"mlp": ((64,), {"hidden": 16}), "lenet5": ((8, 8, 1), {}), "resnet20": ((8, 8, 3), {})}


def model(name):
    shape, kw = MODELS[name]
    return build_model(name, shape, 10, **kw)


def covered(ranges, size):
    """How many times each element of a ``size`` buffer is in ``ranges``."""
    seen = np.zeros(size, np.int64)
    for lo, hi in ranges:
        seen[lo:hi] += 1
    return seen


@pytest.mark.parametrize("name", sorted(MODELS))
def test_layer_spans_cover_the_buffer_once_with_each_parameter_in_its_layers_ranges(name):
    m = model(name)
    spans = m.layer_spans()
    assert len(spans) == len(m.layers)
    assert all(len(s) <= 2 for s in spans)  # its weights, then its biases
    assert (covered([r for s in spans for r in s], m.size) == 1).all()
    layer_of = {n: li for li, n, _ in m.params}
    for n, _, off, size in m.layout():
        assert any(lo <= off and off + size <= hi for lo, hi in spans[layer_of[n]]), n


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("mib", [1e-9, 0.01, 0.05, 1e6])
def test_buckets_are_layers_from_the_last_backward_of_about_the_size_asked(name, mib):
    m = model(name)
    spans = m.layer_spans()
    sizes = [sum(hi - lo for lo, hi in s) for s in spans]
    plan = plan_buckets(spans, mib * 2 ** 20)
    # Together they cover the buffer once.
    assert (covered([r for b in plan for r in b.ranges], m.size) == 1).all()
    assert [b.index for b in plan] == list(range(len(plan)))
    # Each holds whole layers, bucket 0 the last ones: the layers with parameters, in backward order.
    layers = [[li for li, s in enumerate(spans) if s and all(
        any(blo <= lo and hi <= bhi for blo, bhi in b.ranges) for lo, hi in s)] for b in plan]
    assert [li for ls in layers for li in sorted(ls, reverse=True)] == [
        li for li in range(len(spans) - 1, -1, -1) if sizes[li]]
    assert [b.first_layer for b in plan] == [min(ls) for ls in layers]
    assert [b.size for b in plan] == [sum(sizes[li] for li in ls) for ls in layers]
    # A bucket closes once it reaches the size: every bucket but the last holds at least it, and
    # without its first (lowest) layer it would hold less.
    for b, ls in zip(plan[:-1], layers):
        assert b.size * 4 >= mib * 2 ** 20
        assert (b.size - sizes[min(ls)]) * 4 < mib * 2 ** 20
    if mib == 1e-9:  # smaller than any layer: one layer each
        assert all(len(ls) == 1 for ls in layers)
    if mib == 1e6:  # larger than the model: one bucket, the whole buffer in one range
        assert [b.ranges for b in plan] == [((0, m.size),)]
    for b in plan:  # adjacent ranges merged: at most a weights range and a biases range
        assert len(b.ranges) <= 2 and all(hi > lo for lo, hi in b.ranges)


def test_a_bucket_size_must_be_positive():
    with pytest.raises(ValueError, match="bucket_bytes must be > 0"):
        plan_buckets(model("mlp").layer_spans(), 0)
