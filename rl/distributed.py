"""One learner over several processes (hosts): jax.distributed set-up, the roster of hosts, waits
that fail naming a lost host instead of hanging, and the gather of weights to process 0.

Every process runs the same program on the same global mesh (multi-controller JAX). The
coordinator address, process count and process id come from the caller (the Ray learner
actors), else from the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES,
JAX_PROCESS_ID), else from JAX's own cluster detection (SLURM, TPU slices, Open MPI).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable

import numpy as np

ENV_ADDRESS, ENV_PROCESSES, ENV_PROCESS_ID = (
    "JAX_COORDINATOR_ADDRESS",
    "JAX_NUM_PROCESSES",
    "JAX_PROCESS_ID",
)
POLL_S = 0.01  # how often a lockstep wait looks at its outputs
PEER_CHECK_S = 0.5  # how often a wait looks for peers of this node that have ended


class HostLost(RuntimeError):
    """A learner host died, or a lockstep call passed its deadline."""


@dataclasses.dataclass(frozen=True)
class Host:
    """One learner process: its JAX process id, OS pid, node and log file."""

    process_id: int
    pid: int
    node: str
    log: str

    def describe(self) -> str:
        """The host by process id, pid, node and log (what an operator needs to find it)."""
        log = self.log or "its stderr"
        return f"learner host {self.process_id} (pid {self.pid} on {self.node}; log: {log})"


@dataclasses.dataclass
class _Group:
    hosts: tuple[Host, ...] = ()
    me: int = 0
    deadline_s: float = 600.0


_group = _Group()  # this process's view of the learner group (like jax.distributed's own state)


def redirect_output(log_path: str) -> None:
    """Everything the process prints (JAX warnings, tracebacks) goes to log_path."""
    if not log_path:
        return
    os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (for a coordinator address)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}: invalid value {value!r}; expected an int") from None


def initialize(
    hosts: int,
    *,
    coordinator_address: str | None = None,
    process_id: int | None = None,
    log: str | Callable[[int], str] = "",
    deadline_s: float = 600.0,
) -> Host | None:
    """Joins this process to a learner of `hosts` processes (learner.hosts); None when 1.

    Must run before JAX creates its backends (it creates none itself, so a caller may still pin
    threads after it). On CPU the cross-process collectives are gloo. Each host's pid, node and
    `log` are exchanged through the coordinator, so a lost host can be named by any other; `log`
    may be a function of the process id (called once it is known, before the roster is written:
    it may redirect this process's output there). Jobs recover from a lost host only by failing
    it (HostLost): JAX's recoverability mode keeps a survivor alive long enough to say which
    host was lost.
    """
    if hosts == 1:
        return None
    import jax

    address = coordinator_address or os.environ.get(ENV_ADDRESS) or None
    n = _env_int(ENV_PROCESSES)
    if n is not None and n != hosts:
        raise ValueError(
            f"learner.hosts: {hosts}, but {ENV_PROCESSES}={n} in the environment; "
            "they must agree (one learner process per host)"
        )
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID)
    if process_id is not None and not 0 <= process_id < hosts:
        raise ValueError(f"process id: invalid value {process_id}; valid: 0..{hosts - 1}")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    wait = max(1, int(deadline_s))
    # The service listens on the address it is known by (JAX's default: every interface).
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or address
    jax.distributed.initialize(
        address,
        hosts if (address is not None or n is not None) else None,
        process_id,
        initialization_timeout=wait,
        shutdown_timeout_seconds=wait,
        coordinator_bind_address=bind,
    )
    from jax._src import distributed as jd

    found = jd.global_state.num_processes  # not jax.process_count(): that starts the backend
    if found != hosts:
        raise ValueError(
            f"learner.hosts: {hosts}, but jax.distributed found {found} "
            "processes (the cluster's environment); they must agree"
        )
    me_id = jd.global_state.process_id
    log = log(me_id) if callable(log) else log
    log = os.path.abspath(log) if log else ""
    me = Host(me_id, os.getpid(), socket.gethostname(), log)
    kv = client()
    kv.key_value_set(f"tandem/host/{me.process_id}", json.dumps(dataclasses.asdict(me)))
    roster = []
    for i in range(hosts):
        text = kv.blocking_key_value_get(f"tandem/host/{i}", wait * 1000)
        roster.append(Host(**json.loads(text)))
    _group.hosts, _group.me, _group.deadline_s = tuple(roster), me.process_id, deadline_s
    # In the log first: JAX itself ends every host at once when host 0 (its coordination
    # service) is lost, with no word of which host that was; this line names them all.
    print("learner hosts: " + "; ".join(h.describe() for h in roster), flush=True)
    atexit.register(shutdown)  # runs before JAX's own exit hook (registered earlier)
    return me


def cluster_detected() -> str | None:
    """The cluster JAX's own detection finds here (SLURM, a TPU slice, Open MPI), or None."""
    from jax._src import clusters

    for env in clusters.ClusterEnv._cluster_types:
        if env.opt_in_only_method:  # mpi4py: only when asked for
            continue
        try:
            if env.is_env_present():
                return env.__name__
        except Exception:  # noqa: BLE001 - a detector that cannot run here detects nothing
            continue
    return None


def missing_environment() -> list[str]:
    """The environment variables this process lacks to find its learner hosts: empty when the
    coordinator address and process id are set (the process count defaults to learner.hosts),
    or when JAX detects the cluster and fills in the unset ones."""
    missing = [k for k in (ENV_ADDRESS, ENV_PROCESS_ID) if not os.environ.get(k)]
    if missing and cluster_detected() is not None:
        return []
    return missing


def shutdown() -> None:
    """Leaves the group in order: every host reaches an exit barrier, the others disconnect,
    then process 0 (which hosts the coordination service) stops it. Idempotent.

    In recoverability mode JAX's own shutdown does not wait for the other hosts, so process 0
    could stop the service under a host still disconnecting (which JAX then aborts).
    """
    import jax

    if len(_group.hosts) < 2 or client() is None:
        return
    kv = client()
    ids = [h.process_id for h in _group.hosts]
    kv.wait_at_barrier("tandem/exit", int(_group.deadline_s * 1000))
    if is_primary():
        t0 = time.monotonic()
        while time.monotonic() - t0 < _group.deadline_s:
            live = _ask(lambda: set(kv.get_live_nodes(ids)), timeout=1.0)
            if live is not None and live <= {0}:
                break
            time.sleep(POLL_S)
    _group.hosts = ()
    jax.distributed.shutdown()


def client():
    from jax._src import distributed as jd  # the one handle on the coordination service

    return jd.global_state.client


def hosts() -> tuple[Host, ...]:
    """Every learner host of this process's group (empty for a one-process learner)."""
    return _group.hosts


def this_host() -> Host:
    """This process's entry of the roster (a multi-host learner only)."""
    return _group.hosts[_group.me]


def is_primary() -> bool:
    """Whether this process writes what only one host writes (process 0, or a lone process)."""
    return _group.me == 0


def process_devices(devices_per_host: int) -> list:
    """The first devices_per_host devices of every process, process by process (the global
    mesh's device order: the innermost mesh axes stay within a host)."""
    import jax

    out = []
    for p in range(jax.process_count()):
        mine = sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
        if len(mine) < devices_per_host:
            raise ValueError(
                f"learner.mesh needs {devices_per_host} devices on each of the "
                f"{jax.process_count()} learner hosts; host {p} has {len(mine)}"
            )
        out.extend(mine[:devices_per_host])
    return out


def _dead_peers_here() -> list[Host]:
    """The other hosts of this node whose process has ended (a pid check; no network)."""
    me = _group.hosts[_group.me]
    return [h for h in _group.hosts if h.node == me.node and h is not me and not _running(h.pid)]


def _lost_hosts() -> list[Host]:
    """The peers known to be gone: the coordinator's view, and pids checked on this node."""
    me = _group.hosts[_group.me]
    ids = [h.process_id for h in _group.hosts]
    live: dict = {}

    try:
        live = _ask(lambda: set(client().get_live_nodes(ids)), timeout=2.0)
    except Exception:  # noqa: BLE001 - the coordination service itself is gone (process 0)
        live = set(ids) - {0}
    lost = set(ids) - live if live is not None else set()
    lost |= {h.process_id for h in _dead_peers_here()}
    return [h for h in _group.hosts if h.process_id in lost and h.process_id != me.process_id]


def _ask(fn, timeout: float):
    """fn() from a helper thread, or None after `timeout` seconds (a coordination-service call
    answers once every live host asks, so it may block); fn's exception is raised here."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _running(pid: int) -> bool:
    """Whether process `pid` of this node runs (an exited one not yet reaped does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False
    except OSError:
        return True  # no /proc: unknown, so not named


def lost_error(what: str, cause: BaseException | None = None) -> HostLost:
    """A HostLost naming the lost host(s), or every peer when which one is unknown."""
    me = _group.hosts[_group.me]
    lost = _lost_hosts()
    if lost:
        who = "; ".join(h.describe() for h in lost)
        head = f"{what}: lost {who}"
    else:
        peers = "; ".join(h.describe() for h in _group.hosts if h is not me)
        head = f"{what}: no answer from the other learner hosts ({peers})"
    tail = f": {str(cause).strip().splitlines()[0]}" if cause is not None else ""
    return HostLost(f"{head} (seen by {me.describe()}){tail}")


def wait(tree, what: str):
    """`tree` once its arrays are computed; on a multi-host learner, a lost host or a wait past
    the deadline raises HostLost naming the host instead of blocking forever."""
    if len(_group.hosts) < 2:
        return tree
    import jax

    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    t0 = checked = time.monotonic()
    try:
        while not all(x.is_ready() for x in leaves):
            now = time.monotonic()
            if now - t0 > _group.deadline_s:
                raise lost_error(f"{what}: no result within {_group.deadline_s:g}s")
            if now - checked > PEER_CHECK_S:  # a collective may wait on a dead peer unawares
                checked = now
                if _dead_peers_here():
                    raise lost_error(what)
            time.sleep(POLL_S)
        for x in leaves:  # raises the computation's own error (a collective that lost a peer)
            x.block_until_ready()
    except HostLost:
        raise
    except Exception as e:  # noqa: BLE001 - XLA reports a lost peer as a runtime error
        raise lost_error(what, e) from e
    return tree


def fail(err: BaseException) -> None:
    """Reports `err` on stderr and ends this process at once with status 1.

    After a lost host JAX's shutdown would wait for it at a barrier; a survivor exits instead.
    """
    print(f"{type(err).__name__}: {err}", file=sys.stderr, flush=True)
    os._exit(1)


def gather_to_primary(tree):
    """The arrays of `tree` as numpy on process 0 (None elsewhere), one leaf at a time.

    Memory: process 0 holds the whole tree in host memory; every device holds one leaf in full
    while it is gathered (the largest leaf, e.g. the embedding); the other processes keep
    nothing. Every process must call it (the gather is a collective).
    """
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def one(x):
        if not isinstance(x, jax.Array) or x.is_fully_addressable:
            return np.asarray(x) if is_primary() else None
        full = jax.jit(lambda y: y, out_shardings=NamedSharding(x.sharding.mesh, PartitionSpec()))
        y = wait(full(x), "weights gather")
        return np.asarray(y.addressable_data(0)) if is_primary() else None

    return jax.tree.map(one, tree)
