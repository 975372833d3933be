"""Starting or joining Ray, quietly, and spreading the host actors one per node.

Without an address a local Ray instance is started on this machine (tests, a
laptop): every host actor shares it.  ``auto`` or ``HOST:PORT`` joins a
cluster made with ``ray start --head`` / ``ray start --address``; there the
host actors go into a placement group with one bundle per host and the
STRICT_SPREAD strategy (one host per node) when the cluster has enough nodes.

Ray's own log lines (its Python logger, its C++ core's warnings, the
actors' output, and the errors its GCS publishes to the driver, such as
"(raylet) A worker died or was killed ...") stay hidden unless ``ray_logs``
is set: towers says in its own line what went wrong.  ``log_to_driver=False``
does not cover the published errors: the driver prints them from a thread of
its own (``ray._private.worker.listen_error_messages``, on stdout, in colour)
through ``print_worker_logs``, whose module switch ``_worker_logs_enabled``
(the one ``ray.util.rpdb`` turns off while a debugger holds the terminal) is
the only way to silence it; ``connect`` sets it, ``disconnect`` puts it back.

Limits: Ray waits for a GCS without bound (an unreachable address retries for
about a minute; a port where some other server listens hangs for good, deaf
to SIGTERM), so a ``HOST:PORT`` is first probed (``check_ray_address``): one
TCP connect and one HTTP/2 handshake, 3 s each; the GCS speaks gRPC, which
answers the client preface with a SETTINGS frame, and other servers do not.
Nothing else of ours touches the network.

``ray.init`` installs its own SIGTERM and SIGINT handlers; ``connect``
restores the caller's, so SIGTERM and Ctrl-C end a run as on one host.  A
local Ray instance gets a watchdog (``towers.cluster.watchdog``) that stops it
if the driver is killed.

The actors import the towers the driver runs, wherever it was imported from
(Ray's workers see only the driver's script folder and working directory): a
Ray instance ``connect`` starts on this machine runs its job with the package's
folder on ``PYTHONPATH``; a cluster it joins gets the package shipped to every
node (``py_modules``); on a Ray the caller started itself, ``actor_env`` gives
every actor the ``PYTHONPATH`` when all nodes are this machine (docs/hosts.md
says what a user does on several machines).
"""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading

from towers.errors import UserError

CONNECT_TIMEOUT_S = 3.0
PLACEMENT_TIMEOUT_S = 60.0
# Ray starts a worker per CPU for the first driver, in no runtime_env: the job's (the PYTHONPATH of
# ``_this_machine``) differs, so none of them could become a host actor and each only costs a process start.
NO_PRESTART = {"prestart_worker_first_driver": False}


# The HTTP/2 client preface and an empty SETTINGS frame (RFC 9113, 3.4).
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
H2_SETTINGS = 4


def check_ray_address(address: str) -> None:
    """A ``HOST:PORT`` where no gRPC server (a Ray GCS) answers is a UserError, within seconds."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"`ray_address` {address!r} is not auto or HOST:PORT (the address `ray start --head` printed)")
    try:
        conn = socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S)
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise UserError(f"cannot reach a Ray cluster at `ray_address` {address} ({why}): run `ray start --head` "
                        "there, or pass the address it printed") from None
    try:
        conn.sendall(H2_PREFACE)
        head = b""
        while len(head) < 9:  # a frame header: length (3), type (1), flags (1), stream (4)
            more = conn.recv(9 - len(head))
            if not more:
                break
            head += more
    except OSError:
        head = b""
    finally:
        conn.close()
    if len(head) < 9 or head[3] != H2_SETTINGS:
        raise UserError(f"`ray_address` {address} is not a Ray cluster (the server there does not speak Ray's "
                        "gRPC): pass the address `ray start --head` printed") from None


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
            check_ray_address(address)
        level = "INFO" if verbose else "ERROR"
        main = threading.current_thread() is threading.main_thread()
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
        try:
            if address is None:
                ray.init(num_cpus=max(os.cpu_count() or 1, n_hosts + 1), include_dashboard=False,
                         log_to_driver=verbose, logging_level=level, runtime_env=_this_machine(),
                         _system_config=NO_PRESTART)
            else:
                ray.init(address=address, log_to_driver=verbose, logging_level=level,
                         runtime_env={"py_modules": [_package()], "excludes": ["__pycache__/", "*.pyc"]})
        except (ConnectionError, RuntimeError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"cannot join the Ray cluster at `ray_address` {address}: {first}") from None
        finally:
            for sig, handler in handlers.items():  # Ray's handlers would swallow SIGTERM: ours again
                if handler is not None:
                    signal.signal(sig, handler)
        owned = True
        _show_published_errors(verbose)
        if address is None:
            watch_local_ray()
    return ray, owned


def _show_published_errors(show: bool) -> None:
    """Let the driver print the errors Ray's GCS publishes, or not (module doc); absent in another Ray: no-op."""
    from ray._private import worker

    if hasattr(worker, "_worker_logs_enabled"):
        worker._worker_logs_enabled = show


_watchdog: subprocess.Popen | None = None


def watch_local_ray() -> None:
    """Start the watchdog over the Ray processes this driver just started (its children)."""
    global _watchdog
    from towers.cluster.watchdog import children_of

    me = os.getpid()
    ours = {p for p in children_of({me}) if _parent(p) == me}
    _watchdog = subprocess.Popen([sys.executable, "-m", "towers.cluster.watchdog", str(me), *map(str, ours)],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def disconnect(ray) -> None:
    """Stop the Ray instance ``connect`` started, then its watchdog."""
    global _watchdog
    try:
        ray.shutdown()
        _show_published_errors(True)  # Ray's default, for a later ray.init of the caller's own
    finally:
        if _watchdog is not None:
            _watchdog.terminate()
            _watchdog.wait()
            _watchdog = None


def _package() -> str:
    """The folder of the towers package this process imported (this module's package's)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _this_machine() -> dict:
    """A ``runtime_env`` whose workers import this process's towers from its own folder (this machine only)."""
    path = [os.path.dirname(_package())] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(path)}}


def actor_env(ray, owned: bool) -> dict | None:
    """The ``runtime_env`` of each actor of a run, on top of its job's: None where ``connect`` started or
    joined Ray (``owned``: the job already imports this towers), where another node may run the actor (the
    caller's ``ray.init`` decides there), or where the job's workers already import this towers (asked of one
    of them: an actor with a ``runtime_env`` of its own cannot reuse the job's idle workers, and starting new
    ones costs about a second a run); else this machine's path."""
    if owned:
        return None
    here = ray.get_runtime_context().get_node_id()
    if not all(n["NodeID"] == here for n in ray.nodes() if n.get("Alive")):
        return None
    mine = os.path.join(_package(), "__init__.py")
    # A lambda travels by value (a function of this module would need towers to be imported there first).
    theirs = ray.get(ray.remote(num_cpus=0)(lambda: getattr(importlib.util.find_spec("towers"), "origin", None))
                     .remote())
    return None if theirs == mine else _this_machine()


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


def same_priority(niceness: int) -> None:
    """Run at the driver's priority: Ray starts workers niced (15), which on a shared machine would
    starve a host, i.e. every host (they wait for each other), behind any other process."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except OSError:  # raising one's priority needs privileges: stay as Ray started us
        pass
