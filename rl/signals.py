"""SIGTERM / SIGINT (how preemptions and time limits arrive) with a deadline: one handler for
the trainer's process and for the other hosts of a multi-host learner."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable


def on_stop_signals(act: Callable[[str], None], deadline_s: float, overdue: str) -> None:
    """Installs a SIGTERM / SIGINT handler: act(signal name) runs (it may raise, e.g.
    KeyboardInterrupt to stop at once), then past deadline_s the process exits 1 with
    "error: NAME: `overdue`" on stderr (what was asked did not finish in time)."""

    def handler(signum, frame):
        name = signal.Signals(signum).name
        act(name)

        def exit_overdue():
            print(f"error: {name}: {overdue}", file=sys.stderr)
            sys.stderr.flush()
            os._exit(1)

        timer = threading.Timer(deadline_s, exit_overdue)
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
