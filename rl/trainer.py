"""The training loop: the cadence of rollout, update, publish, evaluate and checkpoint.

One loop for sync, one-step-off and fully-async RL: the modes differ only in the staleness
bound eta the coordinator enforces (sync 0, one_step_off 1, async trainer.max_staleness).
Dispatcher threads (rl/dispatch.py) admit groups and deliver finished ones to the buffer; the
learner consumes B groups per update, publishes its weights to the rollout engine every
sync_every updates, evaluates and checkpoints. What is built from the config comes from
rl/build.py: the learner behind one contract (rl.learner.LearnerHandle: in this process, host 0
of a lockstep learner, or Ray actors) and the rollout behind the engine contract, so the loop
never asks which kind it holds.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from rl import build, metrics, placement, staleness, startup
from rl import config as C
from rl.buffer import GroupBuffer, Stopped
from rl.coordinator import Coordinator
from rl.dispatch import Dispatcher
from rl.evaluate import evaluate_held_out
from rl.learner import LearnerLost
from rl.metrics import LoopMeter, MetricsWriter, dump_episodes, engine_metrics, update_row
from rl.partials import SavedPartials
from rl.schedule import ScheduleWriter
from rl.sft import warm_start_run


class Trainer:
    """Builds a run from a RunConfig and trains it (supervised warm start, then RL)."""

    def __init__(
        self,
        cfg: C.RunConfig,
        *,
        run_dir: str | None = None,
        resume: bool = False,
        place: placement.Placement | None = None,
    ):
        """place: the config's placement if the caller resolved it already (launch.train)."""
        self.learner = self._rollout = self.param_server = None
        self._coord = self._dispatcher = self._buffer = None
        self._closed = False
        self.stop_reason: str | None = None  # request_stop(): checkpoint and return
        self._stop_t = 0.0  # when request_stop() was called (time.monotonic)
        self.saved_partials = SavedPartials()  # a preemption checkpoint's, continued at resume
        self.place = place or placement.prepare(cfg)  # backend-dependent settings fail first
        self.cfg = cfg = self.place.config
        self.clock = startup.StartupClock(cfg.trainer.compile_cache, cfg.logging.progress)
        self.run_dir = run_dir or os.path.join(cfg.run_root, cfg.name)
        os.makedirs(self.run_dir, exist_ok=True)
        C.dump(cfg, os.path.join(self.run_dir, "config.yaml"))
        self.tok_dir, tokenizer = build.make_tokenizer(cfg, self.run_dir)
        self.task = build.make_task(cfg, tokenizer)
        self.tokenizer = self.task.tokenizer  # with the chat's end of turn when prompts use it
        self.eval_problems = self.task.problems("eval", cfg.task.num_eval)
        self._train_problems: list = []
        self.eta = build.effective_eta(cfg)
        self.B, self.n = cfg.rollout.prompts_per_update, cfg.rollout.group_size
        try:
            self.learner = build.start_learner(
                cfg, self.tokenizer.vocab_size, self.run_dir, self.place
            )
            restored = self.learner.restore() if resume else None
            self.restored = restored and restored[:2]  # (meta, finished groups), or None
            self.saved_partials = SavedPartials(restored and restored[2])
            step = self.restored[0]["step"] if self.restored else False
            self.writer = MetricsWriter(
                self.run_dir,
                tensorboard=cfg.logging.tensorboard,
                progress=cfg.logging.progress,
                total_updates=cfg.trainer.total_updates,
                resume=step,
            )
            self.schedule = ScheduleWriter(self.run_dir, self.episode_seeds, resume=step)
        except BaseException:
            self.close(failed=True)
            raise
        self.episodes_dir = os.path.join(self.run_dir, "episodes")
        os.makedirs(self.episodes_dir, exist_ok=True)
        self.clock.mark("startup/built_s")

    def close(self, failed: bool = False) -> None:
        """Shuts the run down in order: admission, rollout, engines, task, metrics, then the
        learner (a checkpoint in flight completes; learner hosts and a Ray cluster it started end
        with it, `failed` telling them the run failed). Idempotent; a step that fails is
        reported and the others still run."""
        if self._closed:
            return
        self._closed = True
        coord, parts, dispatcher = self._coord, self._rollout, self._dispatcher
        steps = [coord.stop] if coord is not None else []
        steps += [parts.engine.abort] if parts is not None else []
        steps += [lambda: dispatcher.join(timeout=60)] if dispatcher is not None else []
        if parts is not None:
            steps += [e.close for e in {id(e): e for e in (parts.engine, parts.evaluator)}.values()]
        resources = (getattr(self, "task", None), getattr(self, "writer", None))
        steps += [res.close for res in resources if res is not None]
        if self.learner is not None:
            steps.append(lambda: self.learner.close(failed))
        for step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - the run's own error is what matters
                print("while shutting down:", file=sys.stderr)
                traceback.print_exc()

    # -- building blocks --------------------------------------------------------------------
    def train_problem(self, group: int):
        """The problem of group number `group` (the data cursor walks the train stream)."""
        if group >= len(self._train_problems):
            self._train_problems = self.task.problems("train", 2 * (group + 1) + 64)
        return self._train_problems[group]

    def episode_seeds(self, group: int) -> list[int]:
        """The sampling seeds of group number `group`'s rollouts."""
        return [build.episode_seed(self.cfg.seed, group, i) for i in range(self.n)]

    def group_work(self, admitted: list[tuple[int, int]]) -> list[tuple]:
        """Admitted [(group, version)] as [(group, version, problem, seeds)] for a rollout; a
        group with a saved partial (a preemption's) gets it as a fifth item, to continue."""
        out = []
        for g, v in admitted:
            part = self.saved_partials.take(g)
            item = (g, v, self.train_problem(g), self.episode_seeds(g))
            out.append(item if part is None else (*item, part))
        return out

    def evaluate(self, engine, sampled: bool = False) -> dict:
        """Greedy decoding of the held-out split: accuracy and reward; with `sampled` and
        task.eval_samples k, also pass@1, pass@k and maj@k of k samples."""
        k = self.cfg.task.eval_samples if sampled else 0
        greedy, params = build.sampling(self.cfg, greedy=True), build.sampling(self.cfg)
        return evaluate_held_out(
            engine, self.task, self.tokenizer, self.eval_problems, greedy, params, k
        )

    def publish(self, version: int, coord: Coordinator, buffer: GroupBuffer) -> float:
        """Starts moving the rollout engine to the learner's weights at `version`; returns
        seconds. Once it serves them admission widens; a failure reaches the learner through
        the buffer."""
        t0 = time.perf_counter()
        self._rollout.publish(version, self.learner.weights(), coord.publish, buffer.fail)
        return time.perf_counter() - t0

    def save(self, step: int, coord, buffer, partials: dict | None = None) -> None:
        """A checkpoint: learner state, the coordinator's and buffer's state, finished groups,
        and (a preemption's) the partial groups that were in flight."""
        bstate, groups = buffer.state()
        meta = {"step": step, "version": self.learner.version, "sft_done": True}
        meta.update(coordinator=coord.state(), buffer=bstate)
        self.learner.save(step, meta, groups, partials)

    def wait_saved(self) -> None:
        """Returns once the last checkpoint is committed; a write that failed fails the run."""
        self.learner.wait_saved()

    def _restart_learner(self, why: str, trained: dict, coord, buffer) -> int:
        """A lost learner (a Ray learner actor that died or hung): a new one from the newest
        valid checkpoint (version c), up to trainer.ray.max_learner_restarts. The rollout and
        the buffer keep their work; the groups the updates after c trained are counted lost
        (their slots freed, never dispatched again); admission, the rollout's weights and the
        metrics go back to c. Returns c."""
        self.learner.restart(why)  # the live buffer is newer than the checkpoint's groups
        c = self.learner.version
        buffer.lose(sum(n for v, n in trained.items() if v > c))
        for v in [v for v in trained if v > c]:
            del trained[v]
        coord.publish(c)
        self.publish(c, coord, buffer)
        self.writer.rewind(c)
        self.schedule.rewind(c)
        metrics.set_aside_dumps(self.episodes_dir, c, self.learner.restarts)
        print(f"learner restarted from checkpoint version {c}: {why}", file=sys.stderr)
        return c

    # -- the loop -------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """Ends the run at the next safe point (a preemption): admission stops, the learner
        stops waiting, a checkpoint of the current version and every finished group is
        written, and run() returns with summary["preempted"] set. Safe from a signal handler."""
        self._stop_t = time.monotonic()
        self.stop_reason = reason
        if self._coord is not None:
            self._coord.stop()
        if self._buffer is not None:
            self._buffer.stop(reason)

    def _preempt(self, coord: Coordinator, buffer: GroupBuffer, summary: dict) -> dict:
        """The checkpoint of a stopped run: this version, its finished groups, and the partial
        state of the groups in flight (the engine is aborted; what it generated so far is kept,
        and continued at resume). The rollout gets half of trainer.preempt_deadline_s to
        return; groups it has not returned by then are dispatched again from their prompts."""
        coord.stop()
        partials, ok = {}, True  # ok: the rollout returned its groups in time
        if self._dispatcher is not None:
            self._rollout.engine.abort()
            left = self.cfg.trainer.preempt_deadline_s / 2 - (time.monotonic() - self._stop_t)
            ok = self._dispatcher.join(timeout=max(0.0, left))
            partials = self._dispatcher.partials()
        partials = {**self.saved_partials.left(), **partials}  # not dispatched again: kept
        self.save(self.learner.version, coord, buffer, partials)
        self.wait_saved()
        v, why = self.learner.version, self.stop_reason
        metrics.log_preemption(self.run_dir, buffer, partials, version=v, reason=why, returned=ok)
        summary.update(preempted=self.stop_reason, version=self.learner.version)
        return summary

    def run(self, on_engine=None, on_update=None) -> dict:
        """Trains; returns the last logged metrics (with eval/accuracy before and after).

        Hooks (benchmarks): on_engine(engine) once the rollout engine is built;
        on_update(version, row) before each update's row is logged.
        """
        failed = True
        try:
            out = self._run(on_engine, on_update)
            failed = False
            return out
        finally:
            self.close(failed=failed)

    def _run(self, on_engine, on_update) -> dict:
        cfg, t = self.cfg, self.cfg.trainer
        summary: dict = {}
        if self.restored is None:
            if cfg.sft.steps > 0:
                try:
                    stop = lambda: self.stop_reason  # noqa: E731
                    out = warm_start_run(cfg, self.learner, self.task, self.tokenizer, stop)[0]
                except Stopped:  # nothing to keep: the warm start runs again at resume
                    return {"preempted": self.stop_reason, "version": None}
                summary.update(out)
            first = Coordinator(self.B, self.eta)
            self.save(0, first, GroupBuffer(first))
            self.clock.mark("startup/warm_start_s")
        start = self.learner.version
        # Finished groups from a checkpoint come back; what was in flight is dispatched again
        # (never a group already consumed: trained, filtered or dropped), a group with saved
        # partial state continued after its tokens.
        meta, groups = self.restored or ({}, {})
        coord = Coordinator.from_state(
            meta.get("coordinator", {}),
            groups_per_update=self.B,
            max_staleness=self.eta,
            published_version=start,
            controller=staleness.from_config(cfg),
        )
        buffer = GroupBuffer.from_state(
            coord,
            meta.get("buffer", {}),
            groups,
            stale_policy=t.stale_policy,
            filter_zero_advantage=cfg.algorithm.filter_zero_advantage,
        )
        if self.saved_partials:  # a preemption's partial groups are continued first
            coord.prioritize(self.saved_partials.left())
        buffer.on_skip = self.schedule.skip
        self._coord, self._buffer = coord, buffer
        if self.stop_reason is not None:  # asked to stop while the run was being built
            return self._preempt(coord, buffer, summary)
        built = (self.task, self.tokenizer, self.tok_dir, self.run_dir, self.eval_problems)
        self._rollout = parts = build.make_rollout(cfg, self.learner, self.place, *built)
        rollout, engine, evaluator = parts.slots, parts.engine, parts.evaluator
        self.param_server = parts.param_server  # vLLM hosts reload what it publishes
        self.clock.mark("startup/rollout_s")
        if on_engine is not None:
            on_engine(engine)
        if self.restored is None:
            ev = self.evaluate(evaluator, sampled=True)
            summary["eval/accuracy_start"] = ev["eval/accuracy"]
            self.clock.mark("startup/eval_s")
            self.writer.log(0, 0, {**summary, **ev, **self.clock.row()})
            self.schedule.start(start)
        coord.publish(start)
        dispatcher = Dispatcher(
            rollout,
            coord,
            buffer,
            self.group_work,
            build.sampling(cfg),
            max_groups=max(1, cfg.rollout.batch_size // self.n // rollout.slots),
            deadline_s=t.deadline_s,
        )
        self._dispatcher = dispatcher
        dispatcher.start()
        t_start = time.perf_counter()
        meter = LoopMeter(dispatcher.busy_s, dispatcher.tokens)
        row_len = build.row_length(cfg, self.task, self.tokenizer, self.eval_problems)
        unit = build.pack_unit(cfg)
        version, trained = start, {}  # {version: groups its update trained}, for a restart
        while version < t.total_updates:
            t0 = time.perf_counter()
            try:
                if self.stop_reason is not None:
                    raise Stopped(self.stop_reason)
                groups = buffer.get_batch(self.B, version, timeout=t.deadline_s)
            except Stopped:
                return self._preempt(coord, buffer, summary)
            t_wait = time.perf_counter() - t0
            trained[version + 1] = len(groups)
            try:
                batch = build.update_batch(cfg, groups, row_len=row_len, unit=unit)
                met = self.learner.update(batch, minibatches=cfg.learner.minibatches)
                new = self.learner.version
                sync = new % t.sync_every == 0 or new == t.total_updates
                t_sync = self.publish(new, coord, buffer) if sync else 0.0
                row, stale = update_row(groups, batch, met, version)
                row.update(meter.row(t_wait, t_sync), **buffer.metrics(), **buffer.sampled())
                es = engine.stats()  # first_update: the time to this process's first update
                row.update(
                    engine_metrics(es),
                    **self.task.stats(),
                    **self.clock.first_update(es, self.run_dir),
                )
                row.update(coord.adapt(row))  # the bound, and an adaptive run's next one
                row["coordinator/redispatched"] = float(coord.redispatched)
                row.update(self.learner.stats())
                self.writer.log_histogram(version + 1, "staleness/tokens", stale)
                evaluated = (t.eval_every and new % t.eval_every == 0) or new == t.total_updates
                if evaluated:
                    if evaluator is not engine:
                        evaluator.update_weights(new, self.learner.weights()).wait(t.deadline_s)
                    row.update(self.evaluate(evaluator, sampled=new == t.total_updates))
                self.schedule.update(new, groups, bool(evaluated), coord.eta)
                if on_update is not None:
                    on_update(new, row)
                self.writer.log(new, new, row)
                summary.update(row)
                if cfg.logging.save_episodes:
                    path = os.path.join(self.episodes_dir, f"v{new:06d}.jsonl")
                    dump_episodes(path, groups, self.tokenizer, cfg.logging.save_episodes)
                ce = t.checkpoint_every
                if (ce and new % ce == 0) or new == t.total_updates:
                    self.save(new, coord, buffer)
                if new == t.total_updates:
                    self.wait_saved()
            except LearnerLost as e:
                version = self._restart_learner(str(e), trained, coord, buffer)
                continue
            version = new
        self.wait_saved()
        summary["time/total"] = time.perf_counter() - t_start
        summary["eval/accuracy_end"] = summary.get("eval/accuracy")
        return summary


def train(cfg: C.RunConfig, *, run_dir: str | None = None, resume: bool = False) -> dict:
    """Runs a whole training job from a config; returns the summary metrics."""
    return Trainer(cfg, run_dir=run_dir, resume=resume).run()
