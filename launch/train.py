"""python -m launch.train --config configs/X.yaml [--set key=value ...] [--resume]
python -m launch.train --replay RUN_DIR   (re-runs a recorded run; exit 1 on a difference)"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import traceback


def main(argv: list[str] | None = None) -> int:
    """Parses the command line, validates the config and runs the training job."""
    parser = argparse.ArgumentParser(prog="python -m launch.train", description=__doc__)
    parser.add_argument("--config", help="YAML run config (default: built-in defaults)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. optim.lr=1e-4",
    )
    parser.add_argument("--resume", action="store_true", help="continue the run in its run dir")
    parser.add_argument("--run-dir", help="run directory (default: <run_root>/<name>)")
    parser.add_argument(
        "--replay",
        metavar="RUN_DIR",
        help="re-run a finished run from its schedule in one process and check that every loss "
        "and accuracy equals the run's, bit for bit",
    )
    args = parser.parse_args(argv)
    if args.replay:
        if args.config or args.overrides or args.resume or args.run_dir:
            parser.error("--replay takes only a run directory (its config.yaml is the config)")
        return replay_main(args.replay)

    from rl import config as C

    try:
        cfg = C.load(args.config, args.overrides)
    except (C.ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.learner.hosts > 1 and cfg.trainer.transport == "local":  # this command on every host
        from rl import lockstep

        run_dir = args.run_dir or os.path.join(cfg.run_root, cfg.name)
        try:
            primary = lockstep.join(cfg, run_dir)
        except C.ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        if not primary:  # learner host 1..N-1: runs host 0's learner calls until it ends
            return lockstep.follow(cfg, run_dir)
        code = 1
        try:
            code = train_main(cfg, args)
        finally:  # the other hosts end with this one, also when it raised
            code = lockstep.finish(code)
        return code
    return train_main(cfg, args)


def train_main(cfg, args) -> int:
    """Runs the training job of a validated config (on host 0 of a multi-host learner)."""
    from rl import accelerator, placement
    from rl import config as C

    try:  # what this host cannot run fails now, before the trainer's imports and any work
        place = placement.prepare(cfg)
    except C.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if warning := accelerator.warning(place.backend):  # an accelerator JAX does not use
        print(warning, file=sys.stderr)
    from rl.trainer import Trainer

    try:
        trainer = Trainer(cfg, run_dir=args.run_dir, resume=args.resume, place=place)
        on_preemption(trainer, cfg.trainer.preempt_deadline_s)
        summary = trainer.run()
    except C.ConfigError as e:  # a setting this host cannot run (found before any work)
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the run was shut down (resume with --resume)", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the traceback, then the error itself, last
        traceback.print_exc()
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if summary.get("preempted"):
        at = (
            "during the warm start"
            if summary["version"] is None
            else (f"at version {summary['version']}: checkpoint written")
        )
        print(f"preempted ({summary['preempted']}) {at}; continue with --resume", file=sys.stderr)
        return 0
    keys = ["eval/accuracy_start", "eval/accuracy_end", "sft/time", "time/total"]
    print(json.dumps({k: summary.get(k) for k in keys}))
    return 0


def replay_main(run_dir: str) -> int:
    """Replays a run; 0 when every compared value is bit-identical, 1 at the first difference."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from rl import config as C
    from rl.replay import ReplayMismatch, replay

    try:
        n = replay(run_dir)
    except (C.ConfigError, FileNotFoundError) as e:
        print(f"replay error: {e}", file=sys.stderr)
        return 2
    except ReplayMismatch as e:
        print(f"replay differs: {e}", file=sys.stderr)
        return 1
    print(f"replay identical: {n} logged steps, every loss, reward and accuracy bit for bit")
    return 0


def on_preemption(trainer, deadline_s: float) -> None:
    """SIGTERM / SIGINT (how preemptions and time limits arrive) stop the run at its next safe
    point with a checkpoint; past deadline_s the process exits 1. A second signal stops at once."""
    from rl.signals import on_stop_signals

    def stop(name: str) -> None:
        if trainer.stop_reason is not None:
            raise KeyboardInterrupt
        print(f"{name}: checkpointing, then exiting (at most {deadline_s:g} s)", file=sys.stderr)
        threading.Thread(target=trainer.request_stop, args=(name,), daemon=True).start()

    on_stop_signals(stop, deadline_s, f"not checkpointed within {deadline_s:g} s")


if __name__ == "__main__":
    sys.exit(main())
