"""The rollout worker actor of the `ray` transport: one process with an engine, task, tokenizer.

An engine is a JaxEngine on the flat numpy params the parameter server sends, or a VLLMEngine
over vLLM servers this worker launches on its node (they die with it) and reloads from the HF
directories the parameter server writes. RayRollout (rl/ray_transport.py) starts, health-checks
and replaces these actors; this module is what runs inside them.
"""

from __future__ import annotations

import os
import time

from rl.ray_learner import redirect_output
from rl.transport import pin_threads


class RolloutActor:
    """A rollout worker process: a JaxEngine plus the task and tokenizer; runs whole groups.

    Wrapped with ray.remote by RayRollout (threaded: pings, aborts and weight updates are
    answered while a rollout generates).
    """

    def __init__(
        self,
        name: str,
        model_config,
        weights: dict,
        version: int,
        task: dict,
        tokenizer_files: dict[str, bytes],
        engine_kwargs: dict,
        cores: tuple[int, ...] = (),
        log_path: str = "",
        vllm: dict | None = None,
    ):
        self.name, self.log_path = name, log_path
        redirect_output(log_path)
        if cores:  # before JAX initialises its backend (XLA sizes its pool from the mask)
            pin_threads(cores)
        import tempfile

        import jax
        from flax import nnx

        from models.tokenizer import load_tokenizer
        from models.transformer import Transformer
        from rl.rollout.jax_engine import JaxEngine
        from rl.rollout.process_engine import _Busy, _fill
        from rl.tasks import get_task

        self._fill = _fill
        if vllm is not None:  # vLLM hosts on this node; `weights` is a published HF directory
            self.engine = _launch_vllm(name, weights, version, vllm, log_path)
        else:  # a JAX sampler; `weights` are flat numpy params from the object store
            abstract = nnx.eval_shape(lambda: Transformer(model_config, rngs=nnx.Rngs(0)))
            self.graphdef, self.template = nnx.split(abstract, nnx.Param)
            device = jax.devices()[0]
            params = jax.tree.map(
                lambda x: jax.device_put(x, device), _fill(self.template, weights)
            )
            self.engine = JaxEngine(
                nnx.merge(self.graphdef, params), version=version, **engine_kwargs
            )
        self.task = get_task(task["name"], seed=task["seed"], **task["options"])
        tok_dir = tempfile.mkdtemp(prefix=f"tandem-{name}-tok-")
        for fname, data in tokenizer_files.items():
            with open(os.path.join(tok_dir, fname), "wb") as f:
                f.write(data)
        self.tokenizer = load_tokenizer(tok_dir)
        self.busy = _Busy()
        self.closing = False
        self.install = {"install_s": 0.0, "updates": 0}
        print(f"{name}: pid {os.getpid()}, cores {sorted(os.sched_getaffinity(0))}", flush=True)

    def info(self) -> dict:
        """pid, node, cores and log path of this worker."""
        import ray

        hosts = getattr(self.engine, "hosts", [])  # a vLLM worker's servers
        return {
            "pid": os.getpid(),
            "session": os.getsid(0),
            "node": ray.util.get_node_ip_address(),
            "cores": sorted(os.sched_getaffinity(0)),
            "log": self.log_path,
            "hosts": [(h.url, h.process.pid if h.process else -1, h.log_path) for h in hosts],
        }

    def ping(self) -> int:
        """Health check: answers at once, even while a rollout generates.

        Raises if every vLLM host of this worker has exited (the worker is then replaced).
        """
        hosts = getattr(self.engine, "hosts", None)
        if hosts and all(h.exit_code() is not None for h in hosts):
            raise RuntimeError(
                "every vLLM host of this worker exited: "
                + "; ".join(h.failure_message("exited") for h in hosts)
            )
        return os.getpid()

    def rollout(self, items: list, sampling) -> list:
        """Runs groups [(group id, published version, problem, seeds)]; returns [ObjectRef].

        The one ObjectRef holds the finished groups as pack_groups arrays, put into the object
        store by this process.
        """
        import ray

        from rl.agent import run_episodes
        from rl.ray_transport import pack_groups
        from rl.types import EpisodeGroup

        problems, seeds = [], []
        for _, _, p, s in items:
            problems += [p] * len(s)
            seeds += list(s)
        self.busy.enter()
        tokens = 0
        try:
            eps = run_episodes(
                self.engine, self.task, self.tokenizer, problems, sampling, seeds=seeds
            )
            tokens = sum(e.num_generated for e in eps)
        except Exception:
            if self.closing:  # shutdown() closed the engine under it: nobody reads this
                return []
            raise
        finally:
            self.busy.exit(tokens)
        groups, k = [], 0
        for g, v, p, s in items:
            groups.append(EpisodeGroup(g, p.id, tuple(eps[k : k + len(s)]), v))
            k += len(s)
        return [ray.put(pack_groups(groups))]

    def generate(self, requests: list) -> list:
        """Engine.generate on this worker (evaluation, warm-up)."""
        self.busy.enter()
        gens = []
        try:
            gens = self.engine.generate(requests)
        finally:
            self.busy.exit(sum(len(g.token_ids) for g in gens))
        return gens

    def update_weights(self, version: int, weights, interrupt: bool) -> float:
        """Installs `version`; returns seconds (waits as the engine does).

        weights: flat numpy params (JAX sampler) or a published HF directory (vLLM hosts, which
        drain or continue as rollout.vllm's update mode says).
        """
        t0 = time.perf_counter()
        if isinstance(weights, str):
            self.engine.update_weights(version, path=weights)
        else:
            self.engine.update_weights(
                version, params=self._fill(self.template, weights), interrupt=interrupt
            )
        self.install["install_s"] += time.perf_counter() - t0
        self.install["updates"] += 1
        return time.perf_counter() - t0

    def abort(self) -> None:
        """In-flight and later generations return 'abort' partials until resume()."""
        self.engine.abort()

    def resume(self) -> None:
        """Undoes abort()."""
        self.engine.resume()

    def stats(self) -> dict:
        """Generation busy time, tokens, weight installs, programs traced, pid."""
        return {
            **self.busy.snapshot(),
            **self.install,
            "traces": getattr(self.engine, "traces", 0),
            "pid": os.getpid(),
        }

    def shutdown(self) -> None:
        """Closes the engine (a vLLM worker stops its servers) before the actor is killed."""
        self.closing = True
        self.engine.close()


def _launch_vllm(name: str, path: str, version: int, opts: dict, log_path: str):
    """A VLLMEngine over opts['num_hosts'] vLLM servers launched here, serving `path`.

    The servers die with this process (PR_SET_PDEATHSIG): a killed worker leaves no orphan.
    """
    import tempfile

    from rl.rollout.vllm import VLLMEngine, launch_hosts

    log_dir = os.path.dirname(log_path) if log_path else tempfile.gettempdir()
    hosts = launch_hosts(
        path,
        [os.path.join(log_dir, f"{name}-vllm-{i}.log") for i in range(opts["num_hosts"])],
        ready_timeout_s=opts["ready_timeout_s"],
        seed=opts["seed"],
        host=opts["host"],
        enforce_eager=opts["enforce_eager"],
        extra_args=opts["extra_args"],
        die_with_parent=True,
    )
    return VLLMEngine(
        hosts,
        version=version,
        update_mode=opts["update_mode"],
        request_timeout_s=opts["request_timeout_s"],
        deadline_s=opts["deadline_s"],
        owns_hosts=True,
    )
