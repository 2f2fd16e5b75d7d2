"""The parameter-server actor of the `ray` transport: in-order weight fan-out to the workers.

The driver hands it (version, weights ref, the live rollout workers) and it has every worker
install that version, in publication order (a Ray actor runs one call at a time, in the order
they were sent); a worker lost meanwhile is skipped (its dispatcher replaces it on the newest
weights). For vLLM workers it writes each version's HF directory (rl/param_server.py) first;
with weight_sync 'direct' the workers stream the flat params to their hosts and the directory,
the durable record a replacement worker starts on, is written after they serve (write()).
"""

from __future__ import annotations

import os
import sys
import time

from rl.distributed import redirect_output


class ParamServerActor:
    """Publishes weight versions to the rollout workers, in order; remembers the newest."""

    def __init__(self, log_path: str = "", hf: dict | None = None):
        self.log_path = log_path
        redirect_output(log_path)
        self.server = None
        self.direct = False  # vLLM workers take flat params (directories written after)
        if hf is not None:  # vLLM workers: each version becomes a published HF directory
            from models.params import abstract_params
            from rl.param_server import ParamServer

            hf = dict(hf)
            self.direct = bool(hf.pop("direct", False))
            config = hf.pop("config")
            self.template = abstract_params(config)[1]
            self.server = ParamServer(hf.pop("weights_dir"), config, **hf)

    def info(self) -> dict:
        """pid and log path of the parameter server."""
        return {"pid": os.getpid(), "log": self.log_path}

    def write(self, version: int, weights: list) -> str:
        """Writes weights[0] (flat numpy params) as the HF directory of `version` (vLLM)."""
        import ray

        from models.params import fill_params

        path, _ = self.server.write(version, fill_params(self.template, ray.get(weights[0])))
        self.server.engine_versions["workers"] = version  # kept until a newer one is served
        self.server.retain()
        return path

    def publish(
        self,
        version: int,
        weights: list,
        workers: list,
        deadline_s: float,
        health_deadline_s: float | None = None,
        starting: list[bool] | None = None,
    ):
        """Has every worker install `version`; {install_s, skipped, total_s, weights}.

        weights[0] is the flat numpy params' ObjectRef; JAX workers install it from the object
        store, vLLM workers reload the HF directory written here from it ('weights' in the reply:
        what a replacement worker starts on) or, direct, stream it to their hosts ('weights'
        empty: the caller has write() record the version once it is served). A worker that
        died, fails its health check, or leaves a ping unanswered for health_deadline_s (hung:
        it is killed here, so its dispatcher replaces it at its next call) is skipped: its
        replacement starts on the newest weights. Without this a hung worker would hold the
        version back, and admission with it. A worker still `starting` (its constructor launches
        vLLM hosts and answers no ping) gets the whole deadline_s.
        """
        import ray

        t0 = time.perf_counter()
        disk = self.server is not None and not self.direct
        send = self.write(version, weights) if disk else weights[0]
        refs = [w.update_weights.remote(version, send) for w in workers]
        install, skipped = 0.0, 0
        for i, (w, r) in enumerate(zip(workers, refs)):
            end = time.monotonic() + deadline_s
            health = deadline_s if starting and starting[i] else health_deadline_s or deadline_s
            while True:
                try:
                    wait = max(0.0, min(health, end - time.monotonic()))
                    install = max(install, ray.get(r, timeout=wait))
                    break
                except ray.exceptions.GetTimeoutError:
                    if time.monotonic() >= end:
                        raise
                    try:  # still installing, or hung?
                        ray.get(w.ping.remote(), timeout=health)
                    except ray.exceptions.RayError as e:
                        print(
                            f"version {version}: rollout worker {i} of this publication left a "
                            f"ping unanswered for {health:g}s while installing ({type(e).__name__}"
                            "): killed (its dispatcher replaces it)",
                            file=sys.stderr,
                            flush=True,
                        )
                        ray.kill(w, no_restart=True)
                        skipped += 1
                        break
                except ray.exceptions.RayActorError:
                    skipped += 1
                    break
                except ray.exceptions.RayTaskError:  # lost its engine (vLLM hosts exited), or
                    try:  # a failed update on a healthy worker, which must not serve the old one
                        ray.get(w.ping.remote(), timeout=deadline_s)
                    except ray.exceptions.RayError:
                        skipped += 1
                        break
                    raise
        return {
            "install_s": install,
            "skipped": skipped,
            "total_s": time.perf_counter() - t0,
            "weights": [] if self.direct else [send],
        }
