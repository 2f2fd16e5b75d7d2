"""Preemption: SIGTERM stops a run at its next safe point with a checkpoint of the current version
and every finished group, and exits 0 within trainer.preempt_deadline_s; --resume continues it,
every group trained exactly once. A learner wait ended on purpose takes nothing from the buffer."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from run_files import metric_rows, trained_episodes

from rl.buffer import GroupBuffer, Stopped
from rl.coordinator import Coordinator
from rl.types import Episode, EpisodeGroup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _group(gid: int, rewards) -> EpisodeGroup:
    eps = tuple(
        Episode("p", np.arange(4), np.array([0, 0, 1, 1]), np.zeros(4), np.zeros(4), 2, float(r))
        for r in rewards
    )
    return EpisodeGroup(gid, "p", eps, 0)


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_a_stopped_wait_puts_back_what_it_took(policy):
    coord = Coordinator(3, 0)
    buf = GroupBuffer(coord, stale_policy=policy)
    assert coord.admit(6, timeout=1) == [(i, 0) for i in range(3)]
    buf.put(_group(0, [1, 0]))
    buf.put(_group(1, [1, 1]))  # all-equal rewards: filtered, consumed
    buf.put(_group(2, [0, 1]))
    before = buf.state()
    # The batch needs 3 usable groups; 2 are there: the wait ends by stop() after taking them.
    t = time.perf_counter()
    threading.Timer(0.2, buf.stop, args=("SIGTERM",)).start()
    with pytest.raises(Stopped, match="SIGTERM"):
        buf.get_batch(3, 0, timeout=30)
    assert time.perf_counter() - t < 5
    state, groups = buf.state()
    assert sorted(groups) == [0, 2]  # the usable groups are back; group 1 stays consumed
    assert state["counts"]["filtered"] == 1 and state["counts"]["trained"] == 0
    assert before[0]["next_group"] == 0
    buf.stopped = None  # a resumed buffer: the same two groups come first
    buf.put(_group(3, [0, 1]))
    assert [g.group_id for g in buf.get_batch(3, 0, timeout=5)] == [0, 2, 3]


def test_accounting_adds_up_and_a_rollout_late_to_return_counts_its_groups(tmp_path, capsys):
    """The preemption's accounting: consumed (trained, filtered), buffered, in flight with a
    saved partial, and to start again add up to the dispatched groups; a rollout that did not
    return in time (the fake: its groups are simply never delivered) has its groups counted and
    named as starting again, their tokens lost."""
    from rl.metrics import log_preemption
    from rl.partials import PartialGroup

    coord = Coordinator(2, 2)
    buf = GroupBuffer(coord)
    assert len(coord.admit(8, timeout=1)) == 6
    buf.put(_group(0, [1, 0]))
    buf.put(_group(1, [1, 1]))  # filtered
    buf.put(_group(2, [0, 1]))
    assert [g.group_id for g in buf.get_batch(2, 0, timeout=5)] == [0, 2]
    buf.put(_group(4, [1, 0]))  # finished, waiting for group 3
    partials = {3: PartialGroup(3, "p", 0, ())}
    acc = buf.accounting(partials)
    assert acc["dispatched"] == 6 and (acc["trained"], acc["filtered"]) == (2, 1)
    assert acc["consumed_ids"] == 3 and acc["buffered"] == [4]
    assert acc["partial"] == [3] and acc["restart"] == [5] and acc["stray_partials"] == []

    # the accounting moved from the trainer to rl.metrics.log_preemption (same record, same words)
    log_preemption(str(tmp_path), buf, {}, version=1, reason="SIGTERM", returned=False)
    err = capsys.readouterr().err
    assert "2 to start again" in err and "numbers [3, 5]" in err, err
    with open(tmp_path / "preemptions.jsonl") as f:
        rec = json.loads(f.read())
    assert rec["restart"] == [3, 5] and rec["rollout_returned"] is False
    assert rec["version"] == 1 and rec["partial_tokens"] == 0


def test_a_learner_rewind_sets_aside_the_lost_updates_dumps(tmp_path):
    """After a learner goes back to version c, the dumps of updates after c move to
    episodes/lost/ (named by the restart) instead of being overwritten by the repeated updates,
    so a group trained by a lost update and again later would show."""
    from rl.metrics import set_aside_dumps

    episodes = tmp_path / "episodes"
    episodes.mkdir()
    for v in range(1, 5):
        (episodes / f"v{v:06d}.jsonl").write_text(f'{{"group": {v}, "index": 0}}\n')
    # moved from the trainer to rl.metrics.set_aside_dumps: after version 2, restart number 2
    set_aside_dumps(str(episodes), 2, 2)
    assert sorted(p.name for p in episodes.glob("v*.jsonl")) == ["v000001.jsonl", "v000002.jsonl"]
    lost = sorted(p.name for p in (episodes / "lost").iterdir())
    assert lost == ["restart2-v000003.jsonl", "restart2-v000004.jsonl"]
    kept = (episodes / "lost" / "restart2-v000004.jsonl").read_text()
    assert kept == '{"group": 4, "index": 0}\n'


BASE = [
    "sft.steps=0",
    "task.num_eval=4",
    "rollout.prompts_per_update=2",
    "rollout.group_size=4",
    "rollout.batch_size=8",
    "rollout.max_new_tokens=8",
    "algorithm.filter_zero_advantage=false",
    "trainer.mode=async",
    "trainer.max_staleness=1",
    "trainer.eval_every=0",
    "trainer.preempt_deadline_s=60",
    "logging.progress=false",
    "logging.tensorboard=false",
    "logging.save_episodes=8",  # every trained episode is dumped with its group id
]


def _train(root, *extra):
    cmd = [sys.executable, "-m", "launch.train", "--set", f"run_root={root}", "--set", "name=p"]
    for kv in (*BASE, *extra):
        cmd += ["--set", kv]
    return cmd


def _until_rows(proc, run_dir, n: int, deadline_s: float = 240) -> None:
    """Waits until metrics.jsonl has n rows (the run is alive meanwhile)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < deadline_s:
        if (run_dir / "metrics.jsonl").exists() and len(metric_rows(run_dir)) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no {n} metric rows within {deadline_s} s")


def _children_cpu_s(pid: int) -> float:
    """CPU seconds of the descendants of process `pid` (its rollout process: the sampler)."""
    stats = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, ticks
    kids, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, (ppid, _) in stats.items() if ppid in frontier} - kids
        kids |= frontier
    return sum(stats[p][1] for p in kids) / os.sysconf("SC_CLK_TCK")


def _preempt(
    cmd, run_dir, rows: int, delay_s: float = 0.0, busy_s: float = 0.0, env: dict | None = None
) -> tuple[int, float]:
    """Runs `cmd`, sends SIGTERM `delay_s` after metrics.jsonl has `rows` rows (with busy_s: once
    the run's child processes, its sampler, have computed busy_s CPU seconds since, i.e. are
    generating), and checks the preemption:
    exit 0 within trainer.preempt_deadline_s, the last line naming the version it stopped at.
    Returns (that version, seconds from the signal to the exit). env: extra variables."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", **(env or {}))
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _until_rows(proc, run_dir, rows)
    time.sleep(delay_s)
    if busy_s:
        t0, cpu0 = time.perf_counter(), _children_cpu_s(proc.pid)
        while _children_cpu_s(proc.pid) - cpu0 < busy_s:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.perf_counter() - t0 < 120, "the sampler did not start generating"
            time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    t_sig = time.perf_counter()
    _, err = proc.communicate(timeout=90)
    took = time.perf_counter() - t_sig
    assert proc.returncode == 0, err[-3000:]
    assert took < 60, f"exited {took:.1f} s after SIGTERM"
    last = err.strip().splitlines()[-1]
    assert last.startswith("preempted (SIGTERM) at version "), err[-2000:]
    return int(last.split("at version ")[1].split(":")[0]), took


@pytest.mark.slow
def test_sigterm_checkpoints_exits_zero_and_resume_trains_each_group_once(tmp_path):
    total, run_dir = 12, tmp_path / "p"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    stopped_at, _ = _preempt(_train(tmp_path, f"trainer.total_updates={total}"), run_dir, 4)
    assert 3 <= stopped_at < total
    assert str(stopped_at) in os.listdir(run_dir / "checkpoints")

    again = subprocess.run(
        [*_train(tmp_path, f"trainer.total_updates={total}"), "--resume"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(total + 1))  # each version once
    trained = trained_episodes(run_dir)  # raises on any episode trained twice
    assert sorted(trained) == [(g, i) for g in range(total * 2) for i in range(4)]


# -- nothing lost: groups in flight at the preemption are continued at resume ----------------

LONG_TOKENS = 128
TRACE_DIR = os.path.join(ROOT, "tests", "decode_trace")  # a sitecustomize: tests/decode_trace
PYTHONPATH = os.pathsep.join([TRACE_DIR, ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(":")


def long_generations(tokens: int = LONG_TOKENS) -> list[str]:
    """Overrides that make every rollout generate exactly `tokens` tokens."""
    return [
        "task.name=longtail",
        f"task.options={{min_tokens: {tokens}, max_tokens: {tokens}}}",
        f"rollout.max_new_tokens={tokens}",
    ]


LONG = long_generations()


def check_accounting(run_dir, step: int, saved: dict) -> dict:
    """The preemption's record (preemptions.jsonl) against what lies outside the system's counters:
    its trained groups are those of the episode dumps, its buffered ones the checkpoint's groups
    file, its in-flight ones the checkpoint's partials file; consumed, buffered and in flight add
    up to what was dispatched, and nothing was lost, dropped or left to start again."""
    from rl.checkpoint import load_groups

    with open(run_dir / "preemptions.jsonl") as f:
        acc = [json.loads(line) for line in f][-1]
    assert acc["version"] == step and acc["rollout_returned"], acc
    consumed = acc["trained"] + acc["filtered"] + acc["dropped"] + acc["lost"]
    assert consumed == acc["consumed_ids"], acc  # the counts agree with the consume cursor
    parts = consumed + len(acc["buffered"]) + len(acc["partial"]) + len(acc["restart"])
    assert parts == acc["dispatched"], acc
    assert acc["lost"] == acc["dropped"] == acc["filtered"] == 0, acc  # filter off, keep policy
    assert acc["restart"] == [] and acc["stray_partials"] == [], acc
    trained = {g for g, _ in trained_episodes(run_dir)}
    assert sorted(trained) == list(range(acc["trained"])), (sorted(trained), acc)
    buffered = load_groups(str(run_dir / "checkpoints" / f"groups_{step}.npz"))
    assert sorted(buffered) == acc["buffered"], (sorted(buffered), acc)
    assert sorted(saved) == acc["partial"], (sorted(saved), acc)
    assert acc["partial_tokens"] == sum(p.num_generated for p in saved.values())
    return acc


def preempt_and_resume_keeps_partials(
    tmp_path,
    *extra,
    total: int = 3,
    tokens: int = LONG_TOKENS,
    delay_s: float = 0.0,
    busy_s: float = 0.0,
    count_decodes: bool = False,
    chunk_sleep_s: float = 0.0,
) -> dict:
    """SIGTERM while groups are being generated, then --resume; checks the preemption's
    accounting (check_accounting), that its checkpoint holds the unfinished groups' partial
    state and that each is trained with its saved tokens, log-probs and versions unchanged and
    its generation continued after them. chunk_sleep_s (the JAX sampler; a fake for timing):
    the preempted run's sampler sleeps that long before each decode chunk, so the learner waits
    for it and the signal finds groups in flight. With count_decodes, the resumed run's
    sampler is traced from outside (tests/decode_trace): each continued sample is one request
    whose prompt is its saved tokens and which decodes its budget minus its saved prefix, and no
    request starts one of them again from its prompt. Returns what it measured."""
    from rl.checkpoint import Checkpointer, load_partials

    run_dir = tmp_path / "p"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    cmd = _train(tmp_path, *long_generations(tokens), f"trainer.total_updates={total}", *extra)
    slow = {"DECODE_CHUNK_SLEEP_S": str(chunk_sleep_s), "PYTHONPATH": PYTHONPATH}
    slow = slow if chunk_sleep_s else {}
    # after update 1: the next groups in flight
    stopped_at, took = _preempt(cmd, run_dir, 2, delay_s, busy_s, slow)
    while True:
        assert 1 <= stopped_at < total
        ckpt = Checkpointer(str(run_dir / "checkpoints"))
        try:  # the preemption's checkpoint, verified (sha256 of its groups and partials files)
            step = ckpt.latest_step()
            assert step == stopped_at
            saved = load_partials(ckpt.partials_path(step))
        finally:
            ckpt.close()
        acc = check_accounting(run_dir, step, saved)
        unfinished = [
            (p.group_id, i, s)
            for p in saved.values()
            for i, s in enumerate(p.samples)
            if not s.done
        ]
        if any(s.num_generated for *_, s in unfinished):
            break
        # The signal fell between generations (the next groups not yet started: a fast machine);
        # timing, not a fault: the resumed run is preempted again one update later.
        # (the signal after update stopped_at + 1 must leave an update for the stop to precede)
        assert stopped_at + 2 < total, f"nothing in flight at any preemption: {saved}"
        stopped_at, took = _preempt(
            [*cmd, "--resume"], run_dir, stopped_at + 2, delay_s, busy_s, slow
        )

    trace = tmp_path / "decodes.jsonl"
    if count_decodes:
        env.update(DECODE_TRACE=str(trace), PYTHONPATH=PYTHONPATH)
    again = subprocess.run(
        [*cmd, "--resume"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400
    )
    assert again.returncode == 0, again.stderr[-3000:]
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(total + 1))  # each version once
    assert [r["rollout/tokens_discarded"] for r in rows[1:]] == [0.0] * total
    trained = trained_episodes(run_dir)  # raises on any episode trained twice
    assert sorted(trained) == [(g, i) for g in range(total * 2) for i in range(4)]
    continued = older = 0
    for g, i, s in unfinished:
        if (g, i) not in trained:  # in flight, but past the groups the run trains
            continue
        e = trained[(g, i)]
        n = len(s.tokens)
        assert e["token_ids"][:n] == s.tokens.tolist(), (g, i)
        assert e["behavior_logp"][:n] == s.behavior_logp.tolist(), (g, i)
        assert e["token_versions"][:n] == s.versions.tolist(), (g, i)
        new_versions = e["token_versions"][n:]
        assert len(e["token_ids"]) == s.prompt_len + tokens, (g, i)  # its whole budget
        assert new_versions and min(new_versions) >= stopped_at, (g, i)
        continued += s.num_generated > 0
        older += s.num_generated > 0 and min(s.versions[s.prompt_len :]) < stopped_at
    assert continued, "no partial sample with tokens was trained after the resume"
    got = {"exit_s": took, "partial_groups": len(saved), "continued_samples": continued}
    got.update(older_prefixes=older, accounting={k: acc[k] for k in ("dispatched", "trained")})
    if count_decodes:
        got["decoded_after_resume"] = check_decodes(trace, unfinished, tokens)
    return got


def check_decodes(trace, unfinished, budget: int) -> int:
    """Each saved sample with tokens was continued by exactly one request of the resumed run,
    prompted with its saved tokens, that decoded its budget minus its saved prefix; none was
    started again from its bare prompt. Returns the tokens those requests decoded."""
    sys.path.insert(0, TRACE_DIR)
    try:
        from sitecustomize import prompt_sha
    finally:
        sys.path.remove(TRACE_DIR)
    with open(trace) as f:
        reqs = [json.loads(line) for line in f]
    assert reqs, "the resumed run's sampler was not traced"
    by_prompt: dict[str, list[dict]] = {}
    for r in reqs:
        by_prompt.setdefault(r["prompt_sha"], []).append(r)
    decoded, fresh = 0, {}
    for *_, s in unfinished:  # samples saved before their first token start from the prompt
        if not s.num_generated:
            bare = prompt_sha(s.tokens[: s.prompt_len])
            fresh[bare] = fresh.get(bare, 0) + 1
    for g, i, s in unfinished:
        if not s.num_generated:
            continue
        got = by_prompt.get(prompt_sha(s.tokens), [])
        assert len(got) == 1, (g, i, got)  # continued once, after its saved tokens
        want = budget - s.num_generated
        assert got[0]["max_new"] == want and got[0]["decoded"] == want, (g, i, got[0], want)
        bare = prompt_sha(s.tokens[: s.prompt_len])
        again = len(by_prompt.get(bare, []))  # never regenerated from its prompt
        assert again == fresh.get(bare, 0), (g, i, again, fresh.get(bare, 0))
        decoded += want
    return decoded


@pytest.mark.slow
def test_sigterm_async_sampler_slowed_by_fake_sleeps_keeps_partials_and_resume_decodes_the_rest(
    tmp_path,
):
    """Nothing lost (the JAX engine, async, staleness 1, trainer.partial=drain): SIGTERM with long
    generations in flight; the preemption's accounting adds up, the checkpoint holds the partial
    state, and the resumed run's sampler decodes only what each continued sample had left
    (test_vllm_preemption: the same with a vLLM host under `continue`)."""
    # Async with staleness 1: groups are dispatched a version ahead and generated while the
    # learner trains. The sampler, slowed by 0.1 s before each 16-token decode chunk (a fake for
    # timing), is slower than the learner, so the learner waits for groups in flight when the
    # signal comes (once the sampler process computes after update 1), and under `drain` their
    # saved tokens are older than the version the run resumes at.
    got = preempt_and_resume_keeps_partials(
        tmp_path,
        "trainer.max_staleness=1",
        total=4,
        tokens=1024,
        busy_s=0.1,
        count_decodes=True,
        chunk_sleep_s=0.1,
    )
    print(f"jax engine, async: {got}")
    assert got["older_prefixes"], got  # a regeneration would have replaced these versions
