"""towers against the TF1 multi-GPU tower example's own graph, built in TensorFlow (``tf.compat.v1``) where it is
installed (skipped otherwise; ``sh tools/install_references.sh`` installs it).

The graph is the example's: two towers in one graph, each the MLP's loss (softmax cross-entropy plus L2 on
the weights, ``tf.nn.l2_loss``) on its half of the global batch; ``average_gradients`` (the towers'
gradients stacked and averaged); ``exponential_decay(lr, global_step, decay_steps, rate, staircase)``;
``apply_gradients`` incrementing ``global_step``; then, under ``control_dependencies`` on it,
``ExponentialMovingAverage(0.99, global_step).apply``.  Fed the initial weights and the global batches
of a towers Trainer, it must end each step on towers' weights and EMA to float32 rounding.
"""
from __future__ import annotations

import numpy as np
import pytest

from towers import Config, Trainer

SETTINGS = dict(n_gpu=2, devices="cpu", hidden=16, batch_size=50, lr=0.5, lr_decay=0.5, decay_steps=1,
                staircase=True, ema_decay=0.99, l2=1e-4, quiet=True, summary_every=0)
NAMES = ("layer1/weights", "layer1/biases", "layer2/weights", "layer2/biases")


def example_graph(tf, init: dict, cfg: Config):
    """The example's training graph over ``init``'s weights: (graph, x, y, train_op, {name: variable},
    {name: EMA variable})."""
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, (None, 64))
        y = v1.placeholder(tf.int32, (None,))
        w = {name: v1.get_variable(name.replace("/", "_"), initializer=init[name]) for name in NAMES}
        global_step = v1.train.get_or_create_global_step()
        lr = v1.train.exponential_decay(cfg.lr, global_step, cfg.decay_steps, cfg.lr_decay, staircase=cfg.staircase)
        opt = v1.train.GradientDescentOptimizer(lr)
        tower_grads = []
        for i, (xs, ys) in enumerate(zip(tf.split(x, 2), tf.split(y, 2))):
            with tf.name_scope(f"tower_{i}"):
                hidden = tf.nn.relu(tf.matmul(xs, w["layer1/weights"]) + w["layer1/biases"])
                logits = tf.matmul(hidden, w["layer2/weights"]) + w["layer2/biases"]
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=ys, logits=logits))
                loss += cfg.l2 * (tf.nn.l2_loss(w["layer1/weights"]) + tf.nn.l2_loss(w["layer2/weights"]))
                tower_grads.append(opt.compute_gradients(loss, var_list=[w[n] for n in NAMES]))
        averaged = []  # the example's average_gradients
        for pairs in zip(*tower_grads):
            grad = tf.reduce_mean(tf.stack([g for g, _ in pairs]), axis=0)
            averaged.append((grad, pairs[0][1]))
        apply = opt.apply_gradients(averaged, global_step=global_step)
        ema = v1.train.ExponentialMovingAverage(cfg.ema_decay, global_step)
        with tf.control_dependencies([apply]):
            train_op = ema.apply([w[n] for n in NAMES])
        shadows = {n: ema.average(w[n]) for n in NAMES}
        init_op = v1.global_variables_initializer()
    return graph, x, y, train_op, init_op, w, shadows


def _close(ours, theirs, what):
    scale = float(np.abs(theirs).max())
    assert float(np.abs(ours - theirs).max()) <= 1e-5 * scale, (what, float(np.abs(ours - theirs).max()), scale)


@pytest.mark.slow
@pytest.mark.references
def test_one_step_of_the_tf1_tower_example_matches_towers():
    tf = pytest.importorskip("tensorflow")
    with Trainer(Config(**SETTINGS)) as tr:
        cfg = tr.cfg
        init = {n: v.copy() for n, v in tr.get_weights().items()}
        graph, x, y, train_op, init_op, w, shadows = example_graph(tf, init, cfg)
        with tf.compat.v1.Session(graph=graph) as sess:
            sess.run(init_op)
            for step in (1, 2):  # the second step at half the rate: decay_steps 1, staircase
                xb, yb = tr.source.next_batch()
                tr.train_step(xb, yb)
                feed = {x: xb.reshape(len(xb), -1).astype(np.float32) * np.float32(1 / 255), y: yb}
                sess.run(train_op, feed)
                ours, ours_ema = tr.get_weights(), tr.get_weights(ema=True)
                theirs, theirs_ema = sess.run(w), sess.run(shadows)
                for n in NAMES:
                    assert not np.array_equal(theirs[n], init[n]), n  # the step moved them
                    _close(ours[n], theirs[n], f"step {step} {n}")
                    # TF's first EMA update takes min(0.99, (1 + 1) / (10 + 1)): global_step read after the update
                    _close(ours_ema[n], theirs_ema[n], f"step {step} EMA {n}")
