"""Several hosts on a Ray cluster: one host actor per machine, each a ``towers.Trainer``.

Ray is imported only inside this package, and the package only when
``hosts`` > 1, so one-host users never pay for it.

    session.py  start or join Ray; spread the host actors one per node
    reduce.py   the cross-host mean of CPU hosts through Ray's object store
    hosts.py    the host actor: a Trainer over that host's towers
    ps.py       the parameter-server actor (``sync`` ps and async)
    driver.py   ``ClusterTrainer``: the driver's loop, outputs and checkpoints
"""
