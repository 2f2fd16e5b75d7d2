"""A learner over several hosts without Ray: trainer.transport local with learner.hosts > 1.

The same command runs on every host (`python -m launch.train ...` on each VM of a TPU slice, or
under srun); jax.distributed joins them (rl.distributed, the coordinator from the environment).
Process 0 runs the trainer as with one host (rollout, buffer, metrics, run files, publication);
its learner is a Leader, which publishes every learner call (a sequence number, the method, its
pickled arguments) in jax.distributed's key-value store before running it. Every other process
is a Follower: it reads the calls in order and runs them on its own Learner and Checkpointer,
so the jitted steps run over the global mesh in lockstep, each host placing its own rows of the
batch and writing its own checkpoint shards.

A call's key is deleted once every host has read it (a collective call after it completed).
A follower that dies fails process 0's next collective call with HostLost naming it
(rl.distributed.wait). Process 0 refreshes a keep-alive key every BEAT_S; a follower whose
process 0 is gone, or silent (no call, no keep-alive) for trainer.deadline_s, fails naming it.
Arguments are pickled between the processes of one job: hosts must trust each other.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import sys
import threading
import time
import traceback

from rl import config as C
from rl import distributed
from rl.signals import on_stop_signals

PREFIX = "tandem/lockstep"
BEAT_S = 1.0  # how often process 0 refreshes its keep-alive key
POLL_MS = 1000  # a follower waits for the next call in slices of this many ms


class Channel:
    """Process 0's end of the calls: numbered, published, deleted once every host read them."""

    def __init__(self):
        self.client = distributed.client()
        self.seq = 0  # the next call's number
        self.kept = 0  # the oldest call whose key may still be in the store
        self.broken = False  # a call lost a host: no collective may run any more
        self.ended = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._keep_alive, name="lockstep-beat", daemon=True)
        self._beat.start()

    def _keep_alive(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                self.client.key_value_set(f"{PREFIX}/beat", str(n), allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the coordination service is shutting down
                return
            self._stop.wait(BEAT_S)

    def call(self, method: str, *args) -> int:
        """Publishes method(*args) for the other hosts; returns its number."""
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            seq = self.seq
            self.client.key_value_set_bytes(f"{PREFIX}/call/{seq}", data)
            self.seq += 1
        return seq

    def read_by_all(self, seq: int) -> None:
        """Every host has read the calls up to `seq` (a collective of theirs completed): their
        keys go, so the store does not grow with the run."""
        with self._lock:
            for k in range(self.kept, seq + 1):
                self.client.key_value_delete(f"{PREFIX}/call/{k}")
            self.kept = max(self.kept, seq + 1)

    def end(self, failed: bool) -> None:
        """Ends the followers: they close their checkpointers and exit (1 if `failed`).
        Idempotent."""
        if self.ended:
            return
        self.ended = True
        try:
            self.call("end", failed)
        finally:
            self._stop.set()
            # No thread may be inside a coordination-service call when JAX's shutdown tears
            # the client down (a C++ abort at exit).
            self._beat.join(timeout=10 * BEAT_S)


_channel: Channel | None = None  # process 0's, once join() made it


def channel() -> Channel | None:
    """Process 0's channel to the other learner hosts (None: not a lockstep learner's leader)."""
    return _channel


def stderr_file() -> str:
    """The file this process's stderr goes to, or "" (a terminal, a pipe)."""
    try:
        path = os.readlink("/proc/self/fd/2")
    except OSError:
        return ""
    return path if os.path.isfile(path) else ""


def join(cfg: C.RunConfig, run_dir: str) -> bool:
    """Joins this process to the learner hosts, before JAX starts its backend; True on process
    0 (the trainer). The coordinator, process count and id come from the environment, as JAX
    finds them; none there is a ConfigError naming the variables. Process i > 0 writes
    everything it prints to run_dir/logs/learner-<i>.log, the roster of hosts at its top."""
    global _channel
    n = cfg.learner.hosts
    missing = distributed.missing_environment()
    if missing:
        raise C.ConfigError(
            f"learner.hosts: {n} with trainer.transport 'local' runs this command once on every "
            f"learner host, joined by jax.distributed; this process does not know its hosts: "
            f"{', '.join(missing)} unset and no cluster JAX detects (SLURM, a TPU slice, Open "
            f"MPI). Set {distributed.ENV_ADDRESS} (host:port of process 0), "
            f"{distributed.ENV_PROCESSES}={n} and {distributed.ENV_PROCESS_ID} (0..{n - 1}) on "
            f"every host, or use learner.hosts: 1 (docs/clusters.md)"
        )
    logs = os.path.join(os.path.abspath(run_dir), "logs")

    def log(process_id: int) -> str:
        if process_id == 0:
            return stderr_file()
        path = os.path.join(logs, f"learner-{process_id}.log")
        distributed.redirect_output(path)
        return path

    try:
        distributed.initialize(n, log=log, deadline_s=cfg.trainer.deadline_s)
    except ValueError as e:  # the environment's process count or id disagrees with the config
        raise C.ConfigError(str(e)) from None
    if distributed.is_primary():
        _channel = Channel()
    return distributed.is_primary()


def finish(code: int) -> int:
    """Process 0's exit status `code`, the other hosts ended first (they exit 1 unless it is 0).
    After a lost host this process exits at once: JAX's shutdown would wait for that host."""
    chan = _channel
    if chan is not None and chan.broken:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 1)
    if chan is not None:
        chan.end(failed=code != 0)
    return code


# ---------------------------------------------------------------------------------------------
# Process 0


def lead(cfg: C.RunConfig, vocab_size: int, run_dir: str) -> Leader:
    """Process 0's learner, the other hosts building theirs from the same config at the same
    time."""
    import jax

    from rl.learner_setup import make_learner

    if _channel is None:
        raise C.ConfigError(
            f"learner.hosts: {cfg.learner.hosts} with trainer.transport 'local' needs every host "
            "joined first: start it with `python -m launch.train` on every host (rl.lockstep.join)"
        )
    _channel.call("start", cfg, vocab_size, os.path.abspath(run_dir))
    _, learner, _ = make_learner(cfg, vocab_size, jax.devices(), run_dir)
    return Leader(learner, _channel)


class Leader:
    """Process 0's learner, with the learner contract (rl.learner.LearnerHandle): each call that
    changes or reads the sharded state is published for the other hosts before it runs here.
    Weights and params come back as host numpy arrays gathered to this process (every host
    gathers). Every host saves, waits for and restores its own shards of the same checkpoint
    (Orbax's primary, this one, writes its metadata and the groups files)."""

    restarts = 0  # hosts in lockstep are not replaced: a lost one ends the run

    def __init__(self, learner, chan: Channel):
        self.learner, self.channel = learner, chan
        self._changes = 0  # calls that may have changed the params
        self._host = None  # (changes, host params) of the last gather

    @property
    def traces(self) -> int:
        """This host's learner programs traced (every host traces the same)."""
        return self.learner.traces

    def program_key(self, batch) -> tuple:
        """What selects the compiled update program for `batch` (Learner.program_key)."""
        return self.learner.program_key(batch)

    def lockstep(self, method: str, fn, *args, collective: bool = False):
        """fn() here after publishing method(*args) for the other hosts. A collective call that
        returns has been read by every host; one that lost a host leaves the group broken."""
        seq = self.channel.call(method, *args)
        try:
            out = fn()
        except distributed.HostLost:
            self.channel.broken = True
            raise
        if collective:
            self.channel.read_by_all(seq)
        return out

    # -- what stays on this host ----------------------------------------------------------
    @property
    def state(self):
        """This host's view of the learner state (its shards; checkpoints write it)."""
        return self.learner.state

    @state.setter
    def state(self, value) -> None:  # a restore here (the other hosts restore on their own)
        self.learner.state = value
        self._changes += 1

    @property
    def config(self):
        """The model config."""
        return self.learner.config

    @property
    def mesh(self):
        return self.learner.mesh

    @property
    def step_cfg(self):
        return self.learner.step_cfg

    # -- calls every host runs ------------------------------------------------------------
    @property
    def version(self) -> int:
        """Updates applied (the policy version)."""
        return self.learner.version

    @version.setter
    def version(self, v: int) -> None:
        self.lockstep("set_version", lambda: setattr(self.learner, "version", v), v)

    def update(self, batch, *, minibatches: int = 1, wait: bool = True) -> dict[str, float]:
        """One policy update on every host; the metrics are this host's (equal on all). It
        always waits (wait is the contract's): every host ends the step together."""
        self._changes += 1
        run = lambda: self.learner.update(batch, minibatches=minibatches)  # noqa: E731
        return self.lockstep("update", run, batch, minibatches, collective=True)

    def set_step_cfg(self, step_cfg) -> None:
        """Switches the compiled step on every host."""
        self.lockstep("set_step_cfg", lambda: self.learner.set_step_cfg(step_cfg), step_cfg)

    def reset_optimizer(self, tx) -> None:
        """A fresh optimizer on every host: one of the run's own (rl/learner_setup.py names them;
        an optax transformation holds closures, which do not pickle)."""
        from rl.learner_setup import optimizer_name

        name = optimizer_name(tx)
        if name is None:
            raise ValueError(
                "reset_optimizer: a learner over several hosts without Ray takes only the run's "
                "own optimizers (rl.learner_setup.rl_optimizer / sft_optimizer), not another optax "
                "transformation"
            )
        self._changes += 1
        self.lockstep("reset_optimizer", lambda: self.learner.reset_optimizer(tx), name)

    def params(self):
        """The current params as host numpy arrays (gathered once per change)."""
        if self._host is None or self._host[0] != self._changes:
            gather = lambda: distributed.gather_to_primary(self.learner.params())  # noqa: E731
            self._host = (self._changes, self.lockstep("gather", gather, "params", collective=True))
        return self._host[1]

    def weights(self):
        """The current params as the engines' Weights (host numpy arrays)."""
        from rl.rollout.base import Weights

        return Weights(params=self.params())

    @property
    def model(self):
        """A copy of the model on host numpy arrays (every host gathers): what an engine of
        this host starts from."""
        from flax import nnx

        graphdef, state = nnx.split(self.learner.model)
        gather = lambda: distributed.gather_to_primary(state)  # noqa: E731
        return nnx.merge(graphdef, self.lockstep("gather", gather, "model", collective=True))

    # -- checkpoints: every host its own shards --------------------------------------------
    def save(self, step: int, meta: dict, groups=None, partials=None) -> None:
        """Checkpoint `step` on every host (the groups and partials files: this host's)."""
        run = lambda: self.learner.save(step, meta, groups, partials)  # noqa: E731
        self.lockstep("save", run, step, meta)

    def wait_saved(self) -> None:
        """Returns once every host's last save is committed here."""
        self.lockstep("wait", self.learner.wait_saved)

    def restore(self):
        """The newest checkpoint restored here, every other host restoring its learner from the
        same step; each then checks it restored the checkpoint this host did. (meta, groups,
        partial groups), or None if there is none."""
        ckpt = self.learner.ckpt
        if ckpt.latest_step() is None:
            return None
        run = lambda: ckpt.restore(self.learner.state, None, partials=True)  # noqa: E731
        state, meta, groups, partials = self.lockstep("restore", run, None)
        self.lockstep("restored", lambda: None, _identity(meta))
        self.state = state
        self.version = meta["version"]
        return meta, groups, partials

    def restart(self, why: str) -> None:
        """Hosts in lockstep are not replaced: a lost one ends the run."""
        raise RuntimeError(f"{why}; learner hosts in lockstep are not restarted")

    def stats(self) -> dict[str, float]:
        """The learner's counters for the update's metrics row (none here)."""
        return {}

    def close(self, failed: bool = False) -> None:
        """Ends the other hosts (they close their checkpointers and exit, 1 if `failed`), then
        waits for this host's writes; after a lost host nothing that needs the others."""
        try:
            self.channel.end(failed)
        finally:
            if not self.channel.broken:
                self.learner.close()


def _identity(meta: dict | None) -> tuple:
    """What names a restored checkpoint (its step and version), or () for none."""
    return () if meta is None else (meta.get("step"), meta.get("version"))


# ---------------------------------------------------------------------------------------------
# Processes 1..N-1


class Follower:
    """A learner host other than process 0: runs process 0's learner calls in order."""

    def __init__(self, cfg: C.RunConfig, run_dir: str):
        self.cfg, self.run_dir = cfg, os.path.abspath(run_dir)
        self.deadline_s = cfg.trainer.deadline_s
        self.client = distributed.client()
        self.seq = 0
        self.lead, self.me = distributed.hosts()[0], distributed.this_host()
        self.learner = self.ckpt = None
        self._restored_meta: dict | None = None
        self._heard = time.monotonic()  # when process 0 last gave a sign of life
        self._beat = None
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="lockstep-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Notes each change of process 0's keep-alive key (a blocked read: no change)."""
        while not self._stop.is_set():
            try:
                beat = self.client.key_value_try_get(f"{PREFIX}/beat")
            except Exception:  # noqa: BLE001 - not written yet, or the service is gone
                beat = None
            if beat is not None and beat != self._beat:
                self._beat, self._heard = beat, time.monotonic()
            self._stop.wait(BEAT_S / 2)

    def next_call(self) -> tuple[str, tuple]:
        """The next call of process 0: (method, args). Raises HostLost naming host 0 if it is
        gone, or silent (no call, no keep-alive) for trainer.deadline_s."""
        key = f"{PREFIX}/call/{self.seq}"
        while True:
            try:
                data = self.client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:  # noqa: BLE001 - a timeout, or the service (host 0) gone
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise distributed.HostLost(
                        f"waiting for learner call {self.seq}: lost {self.lead.describe()} "
                        f"(seen by {self.me.describe()}): {str(e).strip().splitlines()[0]}"
                    ) from e
            silent = time.monotonic() - self._heard
            if silent > self.deadline_s:
                raise distributed.HostLost(
                    f"waiting for learner call {self.seq}: no call and no keep-alive from "
                    f"{self.lead.describe()} within trainer.deadline_s={self.deadline_s:g}s "
                    f"(stopped or hung; seen by {self.me.describe()})"
                )
        self.seq += 1
        return pickle.loads(data)

    def run(self) -> int:
        """Follows until process 0 ends the run: 0, or 1 when it ended with an error."""
        import jax

        from rl.learner_setup import make_learner

        method, args = self.next_call()
        if method == "end":
            return self._end(*args)
        if method != "start":
            raise RuntimeError(f"learner call {method!r} before 'start' (a host of another run?)")
        cfg, vocab_size, run_dir = args
        self._check_same(cfg, run_dir)
        _, self.learner, self.ckpt = make_learner(self.cfg, vocab_size, jax.devices(), run_dir)
        here = jax.process_index()
        mine = [d for d in self.learner.mesh.devices.flat if d.process_index == here]
        print(
            f"learner: pid {os.getpid()}, host {self.me.process_id} of {self.cfg.learner.hosts}, "
            f"devices {mine}; following {self.lead.describe()}",
            flush=True,
        )
        while True:
            method, args = self.next_call()
            if method == "end":
                return self._end(*args)
            getattr(self, f"_{method}")(*args)

    def _check_same(self, cfg: C.RunConfig, run_dir: str) -> None:
        """Process 0's config and run directory must be this host's (one command everywhere)."""
        if cfg != self.cfg:
            mine, theirs = _flat(self.cfg), _flat(cfg)
            diff = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
            shown = ", ".join(f"{k}: {theirs.get(k)!r} vs {mine.get(k)!r}" for k in diff[:5])
            raise C.ConfigError(
                f"the config of {self.me.describe()} differs from host 0's ({shown}); run the same "
                "command with the same --config and --set on every host"
            )
        if run_dir != self.run_dir:
            raise C.ConfigError(
                f"run directory: host 0 writes {run_dir}, {self.me.describe()} {self.run_dir}; "
                "every host must see the run directory at the same path (shared storage)"
            )

    def _end(self, failed: bool) -> int:
        self._stop.set()  # the watcher leaves the coordination service before JAX's shutdown
        self._watcher.join(timeout=10 * BEAT_S)
        if self.ckpt is not None:
            self.ckpt.close()
        if failed:
            print(
                f"error: {self.lead.describe()} ended the run with an error (see its log)",
                file=sys.stderr,
                flush=True,
            )
            return 1
        print(f"learner host {self.me.process_id}: done", flush=True)
        return 0

    # -- process 0's calls, run here ------------------------------------------------------
    def _set_version(self, v: int) -> None:
        self.learner.version = v

    def _update(self, batch, minibatches: int) -> None:
        self.learner.update(batch, minibatches=minibatches)

    def _set_step_cfg(self, step_cfg) -> None:
        self.learner.set_step_cfg(step_cfg)

    def _reset_optimizer(self, name: str) -> None:
        from rl.learner_setup import named_optimizer

        self.learner.reset_optimizer(named_optimizer(self.cfg, name))

    def _gather(self, what: str) -> None:
        from flax import nnx

        tree = self.learner.params() if what == "params" else nnx.split(self.learner.model)[1]
        distributed.gather_to_primary(tree)

    def _save(self, step: int, meta: dict) -> None:
        self.ckpt.save(step, self.learner.state, meta)  # groups files: process 0's

    def _wait(self) -> None:
        self.ckpt.wait()

    def _restore(self, step: int | None) -> None:
        self._restored_meta = None
        if step is None and self.ckpt.latest_step() is None:
            return
        state, meta, _ = self.ckpt.restore(self.learner.state, step)
        self.learner.state = state
        self.learner.version = meta["version"]
        self._restored_meta = meta

    def _restored(self, want: tuple) -> None:
        got = _identity(self._restored_meta)
        if got != want:
            raise RuntimeError(
                f"{self.me.describe()} restored checkpoint (step, version) {got or 'none'} from "
                f"{self.ckpt.directory}, host 0 {want or 'none'}: the run directory must be on "
                "storage every host shares"
            )


def _flat(obj, prefix: str = "") -> dict:
    """{dotted key: value} of a config's leaves."""
    if not dataclasses.is_dataclass(obj):
        return {prefix[:-1]: obj}
    out = {}
    for f in dataclasses.fields(obj):
        out.update(_flat(getattr(obj, f.name), f"{prefix}{f.name}."))
    return out


def follow(cfg: C.RunConfig, run_dir: str) -> int:
    """Runs this host's learner for process 0 until it ends the run; the exit status.

    SIGTERM / SIGINT (a preemption reaching every host) leave this host following: process 0
    checkpoints with it and ends it; past trainer.preempt_deadline_s it exits 1."""
    deadline = cfg.trainer.preempt_deadline_s

    def keep_following(name: str) -> None:
        print(f"{name}: host 0 checkpoints the run; following until it ends", file=sys.stderr)

    on_stop_signals(keep_following, deadline, f"not ended by host 0 within {deadline:g} s")
    try:
        import jax

        from rl import startup

        jax.devices()  # every host starts its backend together (they exchange topologies)
        startup.enable_cache(cfg.trainer.compile_cache)
        return Follower(cfg, run_dir).run()
    except distributed.HostLost as e:
        distributed.fail(e)
    except Exception as e:  # noqa: BLE001 - the traceback, then the error itself, last
        traceback.print_exc()
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    return 1
