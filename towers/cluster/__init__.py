"""Several hosts on a Ray cluster: the executor of a ``towers.Trainer`` with ``hosts`` > 1.

One host actor per machine, each a one-host ``towers.Trainer``.

Ray is imported only inside this package, and the package only when
``hosts`` > 1, so one-host users never pay for it.

    session.py   start or join Ray (probed first), keep our signal handlers, a watchdog
    watchdog.py  stops a local Ray instance whose driver was killed
    board.py     shared memory between the actors of one node: counters, arrays, barriers
    reduce.py    the cross-host mean of CPU hosts (a Reducer: shared memory, or the object store)
    hosts.py     the host actor: a Trainer with its share of the batches, its own step loop
    ps.py        the parameter-server actor (``sync`` ps and async) and a host's end of its board
    state.py     the run-level keys of a cluster's state dict; ``call``, the driver's way into an actor's Trainer
    driver.py    ``ClusterExecutor``: start the actors, segments of steps, gather state, a dead host
"""
