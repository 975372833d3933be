"""Several hosts on a Ray cluster: the executor of a ``towers.Trainer`` with ``hosts`` > 1.

One host actor per machine, each running its ``LocalExecutor`` and the sync
mode's ``HostKeeping``, which the driver makes by name and hands over.

Ray is imported only inside this package, and the package only when
``hosts`` > 1, so one-host users never pay for it.

    session.py   start or join Ray (probed first), keep our signal handlers, a watchdog
    watchdog.py  stops a local Ray instance whose driver was killed
    board.py     shared memory between the actors of one node: counters, arrays, barriers
    reduce.py    the cross-host mean of CPU hosts (a Reducer: shared memory, or the object store)
    keeping.py   how hosts stay together: ``HostKeeping`` (one per sync mode), ``AllReduce`` (grads, weights)
    hosts.py     the host actor: its executor with its share of the batches, the loop its keeper gives it
    ps.py        the parameter server (weights, optimizer, EMA), its two modes (ps, async), a host's end of its board
    state.py     the run-level keys of a cluster's state dict; ``call``, the driver's way into an actor
    driver.py    ``ClusterExecutor``: start the actors, segments of steps, gather state, a dead host
"""
