"""The parameter server (a Ray actor): weights, optimizer state and EMA of a run with ``sync`` ps or async.

It holds a one-tower ``towers.Trainer`` on its CPU whose ``batch_size`` is the
examples behind one update (all hosts' towers for ps, one host's for async), so
its learning-rate schedule counts examples as every other mode does.  It never
reads data: hosts send gradients, it applies them.

* ``apply(shares, *grads)`` (ps, as TensorFlow's ``SyncReplicasOptimizer``):
  the hosts' mean gradients, weighted by their tower counts, averaged in host
  order; one update; returns the new weights, which the hosts then pull.
* ``apply_async(grad, version)`` (async): one host's gradient, computed on the
  weights after ``version`` updates, applied as it arrives; its staleness is
  the number of updates applied since that version.

The EMA follows the server's step (fused into the update, as in grads mode).
"""
from __future__ import annotations

import dataclasses

import numpy

from towers.cluster.hosts import flat_state
from towers.devices.placement import CPU, Placement, to_host


class ParameterServer:
    def __init__(self, cfg, model, dataset, examples_per_update: int):
        from towers.trainer import Trainer

        one = dataclasses.replace(cfg, n_gpu=1, devices="cpu", batch_size=examples_per_update, sync="grads",
                                  hosts=1, ray_address=None)
        self.trainer = Trainer(one, model=model, dataset=dataset, placement=Placement(towers=[CPU]),
                               quiet_placement=True)

    def apply(self, shares: list[float], *grads):
        mean = grads[0] * numpy.float32(shares[0])
        for s, g in zip(shares[1:], grads[1:]):
            mean += g * numpy.float32(s)
        self.trainer.apply_gradients(mean)
        return to_host(self.trainer.replicas[0].params, copy=True)

    def apply_async(self, grad, version: int):
        staleness = self.trainer.step - version
        self.trainer.apply_gradients(grad)
        return to_host(self.trainer.replicas[0].params, copy=True), staleness

    def params(self) -> numpy.ndarray:
        return to_host(self.trainer.replicas[0].params, copy=True)

    def state(self) -> dict:
        return flat_state(self.trainer)

    def load_state_dict(self, state: dict) -> None:
        self.trainer.load_state_dict(state, where="resume")
