"""How `deepinfer serve` reacts to SIGTERM and Ctrl-C: the first asks for a graceful stop (drain the in-flight
requests up to a deadline, then abort them, then exit); a second one exits at once. A first signal that comes
while the model loads stops the start as soon as the launcher looks (nothing to drain yet); one that comes in the
moment between the model turning ready and the launcher noticing still drains, because requests may already run."""
from __future__ import annotations

import signal
import sys
from types import FrameType


class ExitNow(Exception):
    """Raised from the signal handler into the main thread: stop everything now."""


class ShutdownSignals:
    def __init__(self) -> None:
        self.requested: str | None = None  # the name of the signal that asked for a graceful stop
        self.serving = False  # set once the launcher has seen the model ready
        self._exiting = False

    def install(self) -> "ShutdownSignals":
        signal.signal(signal.SIGTERM, self.handle)
        signal.signal(signal.SIGINT, self.handle)
        return self

    def handle(self, signum: int, frame: FrameType | None = None) -> None:
        name = signal.Signals(signum).name
        if self._exiting:  # already tearing down: a third signal must not interrupt the cleanup
            return
        if self.requested is None:
            self.requested = name
            print(f"\n{name}: stopping gracefully (Ctrl-C again to exit at once) ...", file=sys.stderr, flush=True)
            return
        self._exiting = True
        raise ExitNow(name)

    def stop_requested(self) -> bool:
        return self.requested is not None
