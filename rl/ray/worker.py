"""The rollout worker actor of the `ray` transport: one process with an engine, task, tokenizer.

Its engine is the run's rollout.engine, built by the engine registry (rl/engines.py): a
JaxEngine on the flat numpy params the parameter server sends, or a VLLMEngine over vLLM servers
this worker launches on its node (they die with it), reloading the HF directories the parameter
server writes. The worker pool (rl/ray/pool.py) starts, health-checks and replaces these
actors; this module is what runs inside them.
"""

from __future__ import annotations

import os
import time

from rl.distributed import redirect_output
from rl.engines import engine_spec
from rl.placement import pin_threads


class RolloutActor:
    """A rollout worker process: an engine plus the task and tokenizer; runs whole groups.

    Wrapped with ray.remote by the WorkerPool (threaded: pings, aborts and weight updates are
    answered while a rollout generates).
    """

    def __init__(
        self,
        name: str,
        model_config,
        weights,
        version: int,
        task: dict,
        tokenizer_files: dict[str, bytes],
        engine: str,
        engine_options: dict,
        cores: tuple[int, ...] = (),
        log_path: str = "",
    ):
        """engine: a registered rollout engine (rl.engines), built by its `worker` builder
        with `engine_options` on `weights` (flat numpy params, or a published HF directory)."""
        self.name, self.log_path = name, log_path
        redirect_output(log_path)
        if cores:  # before JAX initialises its backend (XLA sizes its pool from the mask)
            pin_threads(cores)
        import tempfile

        from models.tokenizer import load_tokenizer
        from rl import config as C
        from rl.tasks import make_task

        C.import_modules(task["imports"])  # the user's registered tasks, rewards and engines
        build = engine_spec(engine).worker
        # hosts: the servers this worker launched (vLLM; they die with it)
        self.engine, self.hosts = build(
            name, model_config, weights, version, engine_options, log_path
        )
        tok_dir = tempfile.mkdtemp(prefix=f"tandem-{name}-tok-")
        for fname, data in tokenizer_files.items():
            with open(os.path.join(tok_dir, fname), "wb") as f:
                f.write(data)
        section = C.build_section(C.TaskSection, task["section"], "task")
        self.task = make_task(
            section, load_tokenizer(tok_dir), preset=task["preset"], imports=task["imports"]
        )
        self.tokenizer = self.task.tokenizer
        self.closing = False
        print(f"{name}: pid {os.getpid()}, cores {sorted(os.sched_getaffinity(0))}", flush=True)

    def info(self) -> dict:
        """pid, node, cores and log path of this worker."""
        import ray

        hosts = self.hosts
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
        hosts = self.hosts
        if hosts and all(h.exit_code() is not None for h in hosts):
            raise RuntimeError(
                "every vLLM host of this worker exited: "
                + "; ".join(h.failure_message("exited") for h in hosts)
            )
        return os.getpid()

    def rollout(self, items: list, sampling) -> list:
        """Runs groups [(group id, published version, problem, seeds)]; returns [ObjectRef].

        The one ObjectRef holds the finished groups as flat arrays (rl.types.groups_to_arrays),
        put into the object store by this process.
        """
        import ray

        from rl.agent import run_groups
        from rl.types import groups_to_arrays

        try:
            groups = run_groups(self.engine, self.task, self.tokenizer, items, sampling)
        except Exception:
            if self.closing:  # shutdown() closed the engine under it: nobody reads this
                return []
            raise
        return [ray.put(groups_to_arrays(groups))]

    def generate(self, requests: list) -> list:
        """The engine's generate on this worker (evaluation, warm-up)."""
        return self.engine.generate(requests)

    def warm(self, prompt_len: int, max_new_tokens: int, truncate: bool) -> int:
        """The engine's warm on this worker: the programs it compiled."""
        return self.engine.warm(prompt_len, max_new_tokens, truncate=truncate)

    def update_weights(self, version: int, weights) -> float:
        """Installs `version` (flat numpy params, or a published HF directory for vLLM hosts);
        returns the seconds until the engine served it."""
        t0 = time.perf_counter()
        self.engine.update_weights(version, weights).wait()
        return time.perf_counter() - t0

    def abort(self) -> None:
        """In-flight and later generations return 'abort' partials until resume()."""
        self.engine.abort()

    def resume(self) -> None:
        """Undoes abort()."""
        self.engine.resume()

    def stats(self) -> dict:
        """The engine's counters (busy time, tokens, weight installs, ...) and this pid."""
        return {**self.engine.stats(), "pid": os.getpid()}

    def shutdown(self) -> None:
        """Closes the engine (a vLLM worker stops its servers) before the actor is killed."""
        self.closing = True
        self.engine.close()
