"""Starting or joining Ray, quietly, and spreading the host actors one per node.

Without an address a local Ray instance is started on this machine (tests, a
laptop): every host actor shares it.  ``auto`` or ``HOST:PORT`` joins a
cluster made with ``ray start --head`` / ``ray start --address``; there the
host actors go into a placement group with one bundle per host and the
STRICT_SPREAD strategy (one host per node) when the cluster has enough nodes.

Ray's own log lines (its Python logger, its C++ core's warnings and the
actors' output) stay hidden unless ``ray_logs`` is set.

Limits: Ray waits about a minute for an unreachable GCS, retrying and
printing warnings, so a ``HOST:PORT`` is first tried with one TCP connect
(3 s); nothing else of ours touches the network.
"""
from __future__ import annotations

import os
import socket

from towers.errors import UserError

CONNECT_TIMEOUT_S = 3.0
PLACEMENT_TIMEOUT_S = 60.0


def check_reachable(address: str) -> None:
    """A ``HOST:PORT`` that accepts no TCP connection is a UserError, within seconds."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"`ray_address` {address!r} is not auto or HOST:PORT (the address `ray start --head` printed)")
    try:
        socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise UserError(f"cannot reach a Ray cluster at `ray_address` {address} ({why}): run `ray start --head` "
                        "there, or pass the address it printed") from None


def connect(address: str | None, verbose: bool, n_hosts: int):
    """Start (or join) Ray; return (ray module, whether this call started it)."""
    if not verbose:  # failed tasks' tracebacks: the driver prints its own one line
        os.environ.setdefault("RAY_IGNORE_UNHANDLED_ERRORS", "1")
    try:
        import ray
    except ModuleNotFoundError as e:  # `pip install .` leaves Ray out: it is the `cluster` extra
        if e.name == "ray" or (e.name or "").startswith("ray."):
            raise UserError("`hosts` > 1 runs on Ray, which is not installed: pip install 'towers[cluster]' "
                            "(or pip install ray), or train on one host") from None
        raise UserError(f"`hosts` > 1 runs on Ray, which is installed but does not import ({e}): reinstall it "
                        "with pip install --force-reinstall 'towers[cluster]'") from None

    owned = False
    if not ray.is_initialized():
        if address not in (None, "auto"):
            check_reachable(address)
        level = "INFO" if verbose else "ERROR"
        try:
            if address is None:
                ray.init(num_cpus=max(os.cpu_count() or 1, n_hosts + 1), include_dashboard=False,
                         log_to_driver=verbose, logging_level=level)
            else:
                ray.init(address=address, log_to_driver=verbose, logging_level=level)
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot join the Ray cluster at `ray_address` {address}: {first}") from None
        owned = True
    return ray, owned


def spread(ray, n_hosts: int, gpus: int):
    """A placement group of one bundle per host; STRICT_SPREAD (one host per node) when there are enough nodes."""
    from ray.util.placement_group import placement_group

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    strategy = "STRICT_SPREAD" if len(nodes) >= n_hosts else "SPREAD"
    bundle = {"CPU": 1, "GPU": gpus} if gpus else {"CPU": 1}
    group = placement_group([bundle] * n_hosts, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        ray.util.remove_placement_group(group)
        raise UserError(f"the Ray cluster cannot place {n_hosts} hosts ({len(nodes)} nodes, "
                        f"{ray.cluster_resources().get('CPU', 0):g} CPUs): lower `hosts` or add nodes")
    return group


def gpus_per_host(ray, n_hosts: int, towers: int, devices: str | None, soft: bool) -> int:
    """GPUs each host actor asks Ray for: its towers', or 0 (CPU hosts).

    Hosts on one machine must not share a GPU (NCCL refuses two ranks on one
    GPU), so each asks for its own; too few GPUs for every host run the
    hosts on the CPU (soft placement), or is an error without it.
    """
    have = int(ray.cluster_resources().get("GPU", 0))
    if devices == "cpu" or have == 0:
        return 0
    if have >= n_hosts * towers:
        return towers
    if not soft:
        raise UserError(f"{n_hosts} hosts x {towers} GPUs asked for, the Ray cluster has {have} GPUs: "
                        "lower `hosts` or `n_gpu`, or drop `soft_placement` to run on the CPU")
    return 0
