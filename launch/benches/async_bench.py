"""python -m launch.bench async: the real trainer, synchronous vs fully async, same samples.

Why: how close fully-async RL comes to its ideal speedup (G + T) / max(Gc, T) over synchronous
RL, on the trainer that training uses (the method: main's docstring)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time

from launch.benches.common import PRESETS, print_result
from rl.placement import core_split, pin_learner


@dataclasses.dataclass
class RunTiming:
    """One trainer run's steady-state figures over its timed window of K updates."""

    mode: str
    partial: str
    transport: str
    wall_s: float  # window wall time
    gen_busy_s: float  # rollout process generation busy time in the window
    train_s: float  # sum of timing/train_step in the window
    sync_s: float  # learner-side weight sync in the window (timing/weight_sync: copy + send)
    transfer_s: float  # weight sync from the update_weights call to the served ack
    wait_s: float  # sum of timing/wait_data (learner idle for data) in the window
    total_s: float  # the whole RL loop, fill and final update included
    staleness_max: float
    partial_ratio: float
    weight_transfer_s: float  # mean weight update of the run, end to end (stats() sync_s)
    learner_cpu_s: float  # CPU time of the learner's process in the window, all threads
    new_shapes: int  # generation programs the rollout process traced (compiled) in the window
    learner_shapes: int  # learner programs traced in the window (-1: a remote learner)
    rollout_cpu_s: float  # CPU time of the rollout process in the window
    saturated_s: float  # the window's samples on the sampler alone, every request at once (sync)
    occupancy: float  # decode rows that produced a token / rows computed, in the window
    saturated_occupancy: float  # the same over the saturated pass (sync; nan otherwise)
    timeline: dict | None = None  # --timeline: timeline_summary of the window (in-process engine)


STALL_S = 0.08  # a scheduler call this long (not a read-back, which waits for the device) stalls


def timeline_summary(events: list, start: float, end: float) -> dict:
    """What a JaxEngine timeline says about the window [start, end): decode chunks and their
    median spacing; slot-seconds empty (each chunk interval times its empty share of the slots)
    with nothing queued (starved: the staleness bound admitted no more) and with rows queued;
    and the scheduler calls that stalled it (admit, install, chunk dispatch >= STALL_S)."""
    win = [e for e in events if start <= e[1] < end]
    chunks = [e for e in win if e[0] == "chunk"]
    gaps = []
    starved = queued = 0.0
    for a, b in zip(chunks, chunks[1:]):
        gaps.append(b[1] - a[1])
        empty = gaps[-1] * (a[6] - a[3]) / a[6]  # (kind, start, end, live, queued, S, C)
        if a[4]:
            queued += empty
        else:
            starved += empty
    stalls = [
        (e[0], round(e[1] - start, 3), round(e[2] - e[1], 3))
        for e in win
        if e[0] != "read" and e[2] - e[1] >= STALL_S
    ]
    return {
        "chunks": len(chunks),
        "chunk_ms": statistics.median(gaps) * 1e3 if gaps else float("nan"),
        "empty_starved_s": starved,
        "empty_queued_s": queued,
        "stalls": stalls,
    }


def _overrides(args, mode: str, partial: str, transport: str = "local") -> list[str]:
    ppu, group = args.prompts, args.group
    return [
        f"model.preset={args.preset}",
        f"model.dtype={args.dtype}",
        "task.name=longtail",
        f"task.num_eval={args.num_eval}",
        f"task.options={{min_tokens: {args.min_tokens}, max_tokens: {args.max_tokens}, "
        f"alpha: {args.alpha}}}",
        "sft.steps=0",
        f"rollout.group_size={group}",
        f"rollout.prompts_per_update={ppu}",
        f"rollout.max_new_tokens={args.max_tokens}",
        f"rollout.batch_size={ppu * group}",
        "algorithm.filter_zero_advantage=false",
        f"learner.minibatches={args.minibatches}",
        f"learner.logprob_chunk={args.logprob_chunk}",
        f"learner.micro_batch_size={args.micro_batch}",
        *(
            ["learner.pack=true", f"learner.pack_length={args.pack}"]
            if args.pack
            else ["learner.pack=false"]
        ),
        f"trainer.mode={mode}",
        f"trainer.max_staleness={0 if mode == 'sync' else args.eta}",
        f"trainer.partial={partial}",
        f"trainer.total_updates={args.warmup + args.updates + 1}",
        "trainer.eval_every=0",
        "trainer.checkpoint_every=0",
        *_placement(args),
        f"trainer.deadline_s={args.deadline}",
        f"trainer.transport={transport}",
        "trainer.ray.num_workers=1",
        "logging.tensorboard=false",
        "logging.progress=false",
        "logging.save_episodes=0",
    ]


def _placement(args) -> list[str]:
    """Overrides that split the host: by device (--rollout-devices) or by CPU core (default)."""
    if args.rollout_devices:
        return [
            "trainer.pin_cores=false",
            f"trainer.rollout_devices={json.dumps(args.rollout_devices)}",
            f"trainer.learner_devices={json.dumps(args.learner_devices)}",
            f"learner.mesh.data={len(args.learner_devices_resolved)}",
        ]
    return [
        "trainer.pin_cores=true",
        f"trainer.rollout_cores={json.dumps(args.rollout_cores)}",
        f"trainer.learner_cores={json.dumps(args.learner_cores)}",
    ]


def _warm_engine(engine, trainer, args) -> None:
    """Compiles the generation programs of every length bucket the task can produce: what
    engine.warm compiles ahead (a JAX sampler on fixed slots: every program they can run), then
    a generate per cache length bucket."""
    import numpy as np

    from rl.rollout.base import GenerationRequest, SamplingParams
    from rl.rollout.jax_programs import FINE_LEN_BUCKETS, LEN_BUCKETS, length_bucket

    prompt = np.asarray(trainer.tokenizer.encode(trainer.train_problem(0).prompt), np.int32)
    rows = args.prompts * args.group
    longest = max(
        len(trainer.tokenizer.encode(trainer.train_problem(i).prompt)) for i in range(256)
    )
    print(f"sampler warmed: {engine.warm(longest, args.max_tokens)} programs", flush=True)
    # Every cache length of either engine kind (on a CPU the cache steps through finer ones).
    buckets = tuple(sorted(set(LEN_BUCKETS) | set(FINE_LEN_BUCKETS)))
    lo = length_bucket(args.min_tokens, buckets)
    hi = length_bucket(args.max_tokens, buckets)
    prev = 0
    for b in buckets:
        if lo <= b <= hi:
            longest = min(prev + 1, args.max_tokens) if prev else min(b, args.max_tokens)
            reqs = [
                GenerationRequest(
                    f"warm-{b}-{i}",
                    prompt,
                    SamplingParams(max_new_tokens=longest if i == 0 else 1, seed=i),
                )
                for i in range(rows)
            ]
            engine.generate(reqs)
        prev = b


def _warm_learner(trainer, args) -> None:
    """Compiles the packed learner's update for the batch shapes a window can produce: batches
    of the window's size drawn from the task's lengths, each distinct shape once."""
    import numpy as np

    from rl import build
    from rl.learner import train_batch
    from rl.types import Episode

    cfg, learner = trainer.cfg, trainer.learner
    unit, row_len = build.pack_unit(cfg), cfg.learner.pack_length
    seen: set = set()
    for b in range(200):
        eps = []
        for g in range(args.prompts):
            p = trainer.train_problem(20_000 + b * args.prompts + g)
            prompt = len(trainer.tokenizer.encode(p.prompt))
            n = min(prompt + min(p.meta["max_new_tokens"], args.max_tokens), row_len + 1)
            one = np.ones(n, np.int32), np.ones(n, np.int8), np.zeros(n, np.float32)
            eps += [Episode(f"warm-{g}", *one, np.zeros(n, np.int32), 1, 0.0)] * args.group
        batch = train_batch(
            eps, np.zeros(len(eps)), row_len=row_len, pack=True, unit=unit, rows=len(eps)
        )
        shape = learner.program_key(batch)
        if shape not in seen:
            seen.add(shape)
            learner.warm(batch, minibatches=cfg.learner.minibatches)
    print(f"learner warmed for {len(seen)} packed batch shape(s): {sorted(seen)}", flush=True)


def _saturated_s(engine, trainer, args) -> tuple[float, float]:
    """(seconds, slot occupancy) of the engine on the window's samples (K updates of the task's
    budgets) at its saturated rate: every request submitted at once, so freed slots always
    refill."""
    import numpy as np

    from rl.rollout.base import GenerationRequest, SamplingParams

    reqs = []
    for g in range(args.updates * args.prompts):
        p = trainer.train_problem(10_000 + g)  # the task's budget distribution, unseen groups
        prompt = np.asarray(trainer.tokenizer.encode(p.prompt), np.int32)
        new = min(p.meta["max_new_tokens"], args.max_tokens)
        for i in range(args.group):
            reqs.append(
                GenerationRequest(
                    f"sat-{g}-{i}", prompt, SamplingParams(max_new_tokens=new, seed=i)
                )
            )
    engine.generate(reqs)  # compiles what the timed pass needs
    before = engine.stats()
    t0 = time.perf_counter()
    engine.generate([dataclasses.replace(r, request_id=r.request_id + "-t") for r in reqs])
    return time.perf_counter() - t0, _occupancy(before, engine.stats())


def _occupancy(first: dict, last: dict) -> float:
    """Slot occupancy between two engine stats() (nan for an engine without the counts)."""
    if "slot_steps" not in first or "slot_steps" not in last:
        return float("nan")
    rows = last["slot_steps"] - first["slot_steps"]
    return (last["useful_steps"] - first["useful_steps"]) / rows if rows else float("nan")


def run_once(
    args, mode: str, partial: str, run_root: str, round_: int = 0, transport: str = "local"
) -> RunTiming:
    """Runs the real trainer in one mode; returns its steady-state window figures."""
    from rl import config as C
    from rl.trainer import Trainer

    name = f"name=bench-async-{transport}-{mode}-{partial}-r{round_}"
    over = _overrides(args, mode, partial, transport)
    cfg = C.load(None, over + [f"run_root={run_root}", name])
    trainer = Trainer(cfg)
    remote = cfg.trainer.transport == "ray"  # the learner is an actor: no local traces
    engines: list = []
    timelines: list = []  # each engine's record_timeline() (--timeline)
    snaps: dict[int, dict] = {}
    rows: dict[int, dict] = {}
    saturated: list[float] = []

    def on_engine(engine) -> None:  # before the first evaluation: compile every length bucket
        engines.append(engine)
        timelines.append(engine.record_timeline() if args.timeline else None)
        if args.timeline and timelines[-1] is None:
            print("--timeline: the sampler runs in another process (needs --rollout-devices)")
        _warm_engine(engine, trainer, args)
        if args.pack and not remote:
            _warm_learner(trainer, args)
        if mode == "sync":  # the sampler alone, saturated: the ideal bound's generation time
            saturated.append(_saturated_s(engine, trainer, args))

    def on_update(version: int, row: dict) -> None:  # the engine's counters as of this update
        now = time.perf_counter()
        stats = engines[0].stats()
        pid = stats["pid"]  # an in-process engine's CPU time is not its own: n/a
        learner_pid = trainer.learner.pid if remote else os.getpid()
        snaps[version] = dict(
            stats,
            now=now,
            learner_cpu=_cpu_seconds(learner_pid),
            rollout_cpu=_cpu_seconds(pid) if pid != os.getpid() else float("nan"),
            learner_traces=-1 if remote else trainer.learner.traces,
        )
        rows[version] = dict(row)

    summary = trainer.run(on_engine=on_engine, on_update=on_update)
    w0, w1 = args.warmup, args.warmup + args.updates
    window = [rows[v] for v in range(w0 + 1, w1 + 1)]
    first, last = snaps[w0], snaps[w1]
    final = snaps[max(snaps)]  # the last update's counters: every weight update of the run
    timeline = None
    if timelines[0] is not None:
        kept = [e for e in timelines[0] if first["now"] <= e[1] < last["now"]]
        timeline = timeline_summary(kept, first["now"], last["now"])
        os.makedirs(args.timeline, exist_ok=True)
        path = os.path.join(args.timeline, f"{mode}-{partial}-{transport}-r{round_}.json")
        with open(path, "w") as f:
            json.dump({"start": first["now"], "summary": timeline, "events": kept}, f)
    return RunTiming(
        mode=mode,
        partial=partial,
        transport=transport,
        wall_s=last["now"] - first["now"],
        gen_busy_s=last["busy_s"] - first["busy_s"],
        train_s=sum(r["timing/train_step"] for r in window),
        sync_s=sum(r["timing/weight_sync"] for r in window),
        transfer_s=(  # full transfer, from the call to the served ack
            last["sync_s"] - first["sync_s"]
            if final["updates"] >= w1
            else sum(r["timing/weight_sync"] for r in window)
        ),
        wait_s=sum(r["timing/wait_data"] for r in window),
        total_s=summary["time/total"],
        staleness_max=max(r.get("staleness/max", 0.0) for r in window),
        partial_ratio=sum(r["partial/ratio"] for r in window) / len(window),
        weight_transfer_s=final["sync_s"] / final["updates"] if final["updates"] else 0.0,
        learner_cpu_s=last["learner_cpu"] - first["learner_cpu"],
        new_shapes=last.get("traces", 0) - first.get("traces", 0),
        learner_shapes=(
            -1 if first["learner_traces"] < 0 else last["learner_traces"] - first["learner_traces"]
        ),
        rollout_cpu_s=last["rollout_cpu"] - first["rollout_cpu"],
        saturated_s=saturated[0][0] if saturated else float("nan"),
        occupancy=_occupancy(first, last),
        saturated_occupancy=saturated[0][1] if saturated else float("nan"),
        timeline=timeline,
    )


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _share_compile_cache(path: str) -> None:
    """Every run (and its rollout process) reuses compiled programs from one disk cache."""
    import jax

    values = {
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_min_compile_time_secs": 0,
        "jax_persistent_cache_min_entry_size_bytes": -1,
    }
    for name, value in values.items():
        os.environ[name.upper()] = str(value)  # the spawned rollout process reads these
        jax.config.update(name, value)


def _loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "n/a"


def _share(cpu_s: float, busy_s: float) -> str:
    """CPU seconds per busy second as a percentage ('n/a' when not measurable)."""
    return "n/a" if math.isnan(cpu_s) else f"{cpu_s / max(busy_s, 1e-9):4.0%}"


def _print_run(t: RunTiming, load: str) -> None:
    """One run's window: each side's busy time, utilisation and the core share it got."""
    busy_l = t.train_s + t.sync_s
    sat = "" if math.isnan(t.saturated_occupancy) else f" (saturated {t.saturated_occupancy:.1%})"
    print(
        f"{t.transport:5s} {t.mode:5s} {t.partial:8s} window {t.wall_s:6.2f}s | rollout: "
        f"generating {t.gen_busy_s:6.2f}s ({t.gen_busy_s / t.wall_s:4.0%}), cpu/busy "
        f"{_share(t.rollout_cpu_s, t.gen_busy_s)} | learner: train {t.train_s:6.2f}s + "
        f"sync {t.sync_s:4.2f}s ({busy_l / t.wall_s:4.0%}), wait {t.wait_s:6.2f}s, cpu/busy "
        f"{_share(t.learner_cpu_s, busy_l)} | staleness max {t.staleness_max:.0f}, "
        f"partial {t.partial_ratio:.2f}, new shapes {t.new_shapes} (learner "
        f"{t.learner_shapes if t.learner_shapes >= 0 else 'n/a'}), transfer "
        f"{t.weight_transfer_s * 1e3:.0f}ms, slot occupancy {t.occupancy:.1%}{sat} | "
        f"load [{load}]",
        flush=True,
    )
    if t.timeline is not None:
        tl = t.timeline
        print(
            f"  sampler timeline: {tl['chunks']} chunks, {tl['chunk_ms']:.1f} ms apart (median); "
            f"slots empty {tl['empty_starved_s']:.2f}s with nothing queued, "
            f"{tl['empty_queued_s']:.2f}s with rows queued; stalls >= {STALL_S * 1e3:.0f} ms "
            f"(call, at, seconds): {tl['stalls']}",
            flush=True,
        )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.bench async", description=__doc__.split("\n")[0]
    )
    p.add_argument("--updates", type=int, default=20, help="timed updates K per run")
    p.add_argument("--prompts", type=int, default=8, help="prompts (groups) per update")
    p.add_argument("--group", type=int, default=4, help="samples per prompt")
    p.add_argument("--eta", type=int, default=2, help="max_staleness of the async run")
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="updates before the timed window (default and least: eta + 1; more lets every "
        "program shape compile before it, e.g. the longer prefills of continued partials)",
    )
    p.add_argument(
        "--partial",
        default="drain",
        help="async in-flight policies, comma-separated (drain, continue, inflight); both = "
        "drain,continue",
    )
    p.add_argument(
        "--transport",
        default="local",
        help="local, ray, or local,ray (both on the same workload; RESULT adds the overheads)",
    )
    p.add_argument("--min-tokens", type=int, default=16, help="shortest generation budget")
    p.add_argument("--max-tokens", type=int, default=256, help="longest generation budget")
    p.add_argument("--alpha", type=float, default=1.0, help="Pareto tail index of the budgets")
    p.add_argument("--minibatches", type=int, default=1, help="optimizer steps per update")
    p.add_argument(
        "--preset",
        default="tiny",
        choices=PRESETS,
        help="model shape (random init; a GPU needs more than tiny to keep both sides busy)",
    )
    p.add_argument(
        "--micro-batch", type=int, default=0, help="learner.micro_batch_size (0 = whole batch)"
    )
    p.add_argument(
        "--pack",
        type=int,
        default=0,
        help="learner.pack_length: pack samples into rows of this many tokens (0: one sample a "
        "row, padded to the longest)",
    )
    p.add_argument(
        "--logprob-chunk", type=int, default=0, help="learner.logprob_chunk (large vocabularies)"
    )
    p.add_argument("--num-eval", type=int, default=8, help="held-out problems (start/end eval)")
    p.add_argument("--rollout-cores", type=int, nargs="+", default=[0])
    p.add_argument("--learner-cores", type=int, nargs="*", default=[])
    p.add_argument(
        "--rollout-devices",
        type=int,
        nargs="*",
        default=[],
        help="split by device, not core: the rollout engine's jax.devices() indices (e.g. 0)",
    )
    p.add_argument(
        "--learner-devices",
        type=int,
        nargs="*",
        default=[],
        help="with --rollout-devices: the learner's devices (default: every other device)",
    )
    p.add_argument("--deadline", type=float, default=600.0, help="trainer.deadline_s")
    p.add_argument("--run-root", help="where run directories go (default: a temp dir)")
    p.add_argument("--repeats", type=int, default=1, help="rounds of (sync, async) runs")
    p.add_argument(
        "--timeline",
        help="a directory: an in-process sampler (--rollout-devices) records its scheduler's "
        "calls; each run writes its window's to DIR/<mode>-<partial>-<transport>-r<round>.json "
        "and prints a summary (empty slots, stalls)",
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="compute dtype"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs sync then async on the same workload; prints the figures and a RESULT line.

    Both runs use one config (the --preset model, tiny by default, bfloat16 compute by default, the
    long-tailed synthetic task `longtail`, no supervised stage, trainer.pin_cores: the rollout
    engine in a child process pinned to --rollout-cores, this learner process pinned to the
    remaining cores), so they compare like with like. The sync run (eta 0) gives
      G  generation busy time, measured inside the rollout process (union of generate calls), and
      T  learner busy time: train step + weight sync (timing/train_step + the time from the
         learner's update_weights call to the rollout process serving the weights),
    and Gc, the time the sampler alone needs for the window's samples at its saturated rate (the
    same number of requests from the task's budget distribution, submitted at once right after
    the sync run's engine is built, so continuous batching keeps every slot busy). The ideal async
    bound is (G + T) / max(Gc, T): generation at the sampler's saturated rate, fully overlapped
    with training (with static batching Gc ~ G and this is (G + T) / max(G, T)). The async run
    uses max_staleness --eta and the --partial policies (drain, continue, inflight).

    Timing is steady state: the first W = eta + 1 updates (compilation, pipeline fill) are excluded
    in every run, and sync_s / async_s is the wall time from the completion of update W to the
    completion of update W + K (K = --updates), so each covers K updates of prompts * group samples.
    G and T are summed over the same window of the sync run (differences of the engine's
    cumulative stats() taken at updates W and W + K). Once the rollout engine is built (the
    trainer's on_engine hook, before the first evaluation) it compiles every generation-length
    bucket of the task, so a rare long batch does not compile inside the window, and all runs
    share a persistent compilation cache. The final update (with its
    evaluation) is outside the window. With --repeats R the rounds (sync, then async) alternate, so
    a change in machine load hits both modes; each round gives its own speedup and ideal (from its
    own sync run), and the RESULT holds the medians over rounds. Each run also reports the CPU time
    each process got while busy (cpu/busy): well below 100% means other processes on the machine
    took its core, and the run measured the machine, not the overlap.

    With --rollout-devices (a host with several accelerators, e.g. two GPUs) the split is by device
    instead of by core: the rollout is an in-process JaxEngine on those devices (weights moved
    device to device by jax.device_put), the learner's mesh (data parallel) holds --learner-devices
    (default: the other devices), nothing is pinned, and cpu/busy reads n/a (one process). G is then
    the wall time during which the engine has a batch running.

    --transport picks how rollout and learner talk: `local` (the rollout process is a pinned child
    over a pipe), `ray` (one rollout worker actor pinned to the same cores, the learner an actor
    pinned to the learner's cores, the parameter server an actor; weights and episode batches
    through the Ray object store; this process keeps the coordinator and buffer), or `local,ray`:
    both on the same workload, round by round, with `overhead_sync` and `overhead_async` = ray wall
    time / local wall time over the same window.

    Prints per-run figures (with the load average at each run's start), then `RESULT sync_s=...
    async_s=... speedup=... ideal=... frac_of_ideal=... G_s=... T_s=...` (the first --transport and
    --partial; the other partials add suffixed keys, a second transport adds `_ray` keys and the
    overheads), and `window_compiles`: programs traced inside the timed windows of all runs
    (nonzero means a window's time includes compilation).
    """
    args = _parser().parse_args(argv)
    partials = ["drain", "continue"] if args.partial == "both" else args.partial.split(",")
    if any(x not in ("drain", "continue", "inflight") for x in partials):
        print(
            f"--partial={args.partial!r}: valid: drain, continue, inflight (comma-separated), both",
            file=sys.stderr,
        )
        return 2
    for name in ("updates", "prompts", "group", "min_tokens", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    transports = args.transport.split(",")
    if not transports or any(t not in ("local", "ray") for t in transports):
        print(f"--transport={args.transport!r}: valid: local, ray, local,ray", file=sys.stderr)
        return 2
    if args.group < 2 or args.eta < 0:
        print("--group must be >= 2 and --eta >= 0", file=sys.stderr)
        return 2
    if args.warmup and args.warmup < args.eta + 1:
        print(f"--warmup={args.warmup}: must be >= eta + 1 = {args.eta + 1}", file=sys.stderr)
        return 2
    args.warmup = args.warmup or args.eta + 1
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.rollout_devices:  # one process; the trainer validates the indices
        if transports != ["local"]:
            print("--rollout-devices needs --transport local", file=sys.stderr)
            return 2
        import jax

        devices = jax.devices()
        args.learner_devices_resolved = args.learner_devices or [
            i for i in range(len(devices)) if i not in args.rollout_devices
        ]
        names = {i: str(d) for i, d in enumerate(devices)}
        where = (
            f"rollout devices {[names.get(i, i) for i in args.rollout_devices]}, learner devices "
            f"{[names.get(i, i) for i in args.learner_devices_resolved]} (jax {jax.__version__})"
        )
    else:
        # Before anything initialises JAX's backend (XLA sizes its thread pool from the mask).
        split = core_split(args.rollout_cores, args.learner_cores)
        pin_learner(split.learner)
        where = f"rollout cores {list(split.rollout)}, learner cores {list(split.learner)}"
    print(
        f"async bench: {args.preset} model ({args.dtype}), longtail budgets "
        f"Pareto({args.alpha}) in [{args.min_tokens}, {args.max_tokens}], {args.prompts} prompts "
        f"x {args.group} samples per update, K={args.updates} timed updates after "
        f"W={args.warmup}, {args.repeats} round(s); {where}; async eta={args.eta}; "
        f"transport {', '.join(transports)}",
        flush=True,
    )
    run_root = args.run_root or tempfile.mkdtemp(prefix="bench-async-")
    _share_compile_cache(os.path.join(run_root, "jit_cache"))
    rows: dict[tuple[str, str], list[dict]] = {(t, p): [] for t in transports for p in partials}
    compiles = 0  # programs traced inside timed windows, sampler and local learner, all runs
    for r in range(args.repeats):  # rounds alternate the modes, so load drift hits both
        for transport in transports:
            load = _loadavg()
            sync = run_once(args, "sync", "drain", run_root, r, transport)
            _print_run(sync, load)
            compiles += sync.new_shapes + max(sync.learner_shapes, 0)
            G, T, Gc = sync.gen_busy_s, sync.train_s + sync.transfer_s, sync.saturated_s
            ideal = (G + T) / max(Gc, T)
            print(
                f"round {r} ({transport}): sync G={G:.2f}s T={T:.2f}s (G/T={G / T:.2f}), other "
                f"{sync.wall_s - G - T:.2f}s; sampler saturated Gc={Gc:.2f}s (G/Gc="
                f"{G / Gc:.2f}); ideal async bound (G+T)/max(Gc,T) = {ideal:.3f}",
                flush=True,
            )
            for partial in partials:
                load = _loadavg()
                a = run_once(args, "async", partial, run_root, r, transport)
                _print_run(a, load)
                compiles += a.new_shapes + max(a.learner_shapes, 0)
                speedup = sync.wall_s / a.wall_s
                print(
                    f"round {r} ({transport}): async ({partial}) {a.wall_s:.2f}s vs sync "
                    f"{sync.wall_s:.2f}s: speedup {speedup:.3f}, ideal {ideal:.3f}, "
                    f"{speedup / ideal:.1%} of ideal",
                    flush=True,
                )
                rows[transport, partial].append(
                    dict(
                        sync_s=sync.wall_s,
                        async_s=a.wall_s,
                        speedup=speedup,
                        ideal=ideal,
                        frac_of_ideal=speedup / ideal,
                        G_s=G,
                        T_s=T,
                        Gc_s=Gc,
                        occupancy=a.occupancy,
                        saturated_occupancy=sync.saturated_occupancy,
                    )
                )
    result: dict[str, float] = {}
    meds = {}
    for (transport, partial), runs in rows.items():
        med = {k: statistics.median(row[k] for row in runs) for k in runs[0]}
        meds[transport, partial] = med
        if len(runs) > 1:
            print(
                f"median of {len(runs)} rounds, {transport} async ({partial}): sync "
                f"{med['sync_s']:.2f}s, async {med['async_s']:.2f}s, speedup {med['speedup']:.3f}"
                f", ideal {med['ideal']:.3f}, {med['frac_of_ideal']:.1%} of ideal",
                flush=True,
            )
        if transport != transports[0]:
            for k in ("sync_s", "async_s", "speedup"):
                result[f"{k}_{transport}"] = med[k]
        elif partial == partials[0]:
            result.update(med)
        else:
            for k in ("async_s", "speedup", "frac_of_ideal"):
                result[f"{k}_{partial}"] = med[k]
    if len(transports) > 1:  # the second transport's wall time over the first's, same window
        a, b = meds[transports[0], partials[0]], meds[transports[1], partials[0]]
        result["overhead_sync"] = b["sync_s"] / a["sync_s"]
        result["overhead_async"] = b["async_s"] / a["async_s"]
        print(
            f"{transports[1]} vs {transports[0]} (same workload, window of {args.updates} "
            f"updates): sync {b['sync_s']:.2f}s vs {a['sync_s']:.2f}s "
            f"({result['overhead_sync'] - 1:+.1%}), async {b['async_s']:.2f}s vs "
            f"{a['async_s']:.2f}s ({result['overhead_async'] - 1:+.1%})",
            flush=True,
        )
    result["window_compiles"] = compiles
    result["load1"] = float(_loadavg().split()[0])
    print_result(result, digits=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
