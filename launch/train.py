"""python -m launch.train --config configs/X.yaml [--set key=value ...] [--resume]"""

from __future__ import annotations

import argparse
import json
import os
import signal
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
    args = parser.parse_args(argv)

    from rl import config as C

    try:
        cfg = C.load(args.config, args.overrides)
    except (C.ConfigError, FileNotFoundError) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from rl import placement

    try:  # what this host cannot run fails now, before the trainer's imports and any work
        place = placement.prepare(cfg)
    except C.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
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


def on_preemption(trainer, deadline_s: float) -> None:
    """SIGTERM / SIGINT (how preemptions and time limits arrive) stop the run at its next safe
    point with a checkpoint; past deadline_s the process exits 1. A second signal stops at once."""

    def handler(signum, frame):
        name = signal.Signals(signum).name
        if trainer.stop_reason is not None:
            raise KeyboardInterrupt
        print(f"{name}: checkpointing, then exiting (at most {deadline_s:g} s)", file=sys.stderr)
        threading.Thread(target=trainer.request_stop, args=(name,), daemon=True).start()

        def overdue():
            print(f"error: {name}: not checkpointed within {deadline_s:g} s", file=sys.stderr)
            os._exit(1)

        timer = threading.Timer(deadline_s, overdue)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


if __name__ == "__main__":
    sys.exit(main())
