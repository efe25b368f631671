"""The engine's host loop in a thread of its own, which other threads talk to without ever waiting on
a dispatch.

    worker = Worker(engine, on_fatal=lambda reason: server_should_exit())
    worker.start()
    r = engine.request(ids, 64, on_tokens=..., on_done=...)   # checked on the caller's thread
    worker.submit(r)                                         # queued; never blocks on a dispatch
    worker.cancel(r)                                         # taken before the next dispatch
    worker.stop()                                            # every live request ends ("error": shutting down)

Submissions and cancels go through an inbox (a lock held only to append or swap a list), so an HTTP
event loop never waits for the device. An exception while admitting one request fails that request
alone (Engine.step contains it); an exception the engine cannot contain (a dispatch, a bug) marks the
worker failed: every waiting request ends at once with the reason, `healthy` turns False, later
submissions are refused, and `on_fatal(reason)` is called so the process can exit non-zero.
"""
from __future__ import annotations

import sys
import threading
import traceback
from typing import Callable, Optional

from .engine import Engine, Request


class EngineUnavailable(RuntimeError):
    """The worker takes no more requests: it failed or is shutting down."""


class Worker:
    def __init__(self, engine: Engine, on_fatal: Optional[Callable[[str], None]] = None,
                 on_step: Optional[Callable[[Engine], None]] = None,
                 on_ended: Optional[Callable[[Request], None]] = None):
        """`on_step(engine)` after every pass of the loop (metrics); `on_ended(request)` once per request
        as it ends, before its own on_done; `on_fatal(reason)` once if the engine fails."""
        self.engine, self.on_fatal, self.on_step, self.on_ended = engine, on_fatal, on_step, on_ended
        self.error: Optional[str] = None  # why the engine failed; None while healthy
        self.stopping = False
        self._cv = threading.Condition()  # guards the inbox and the flags; never held during a dispatch
        self._inbox: list = []  # ("submit" | "cancel", request), in arrival order
        self._live: set = set()  # submitted requests not yet told they ended
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)

    @property
    def healthy(self) -> bool:
        return self.error is None and not self.stopping and self.thread.is_alive()

    @property
    def live(self) -> set:
        """Submitted requests whose waiters have not yet been told they ended."""
        with self._cv:
            return set(self._live)

    @property
    def waiting(self) -> int:
        """Requests queued, in the engine or still in the inbox."""
        return len(self.engine.queue) + sum(1 for kind, _ in self._inbox if kind == "submit")

    def start(self) -> None:
        self.thread.start()

    def submit(self, r: Request) -> None:
        """Queue a request made by engine.request(); EngineUnavailable when the worker takes no more."""
        with self._cv:
            if self.error is not None or self.stopping or not self.thread.is_alive():
                raise EngineUnavailable(self.error or "the server is shutting down")
            self._live.add(r)
            self._inbox.append(("submit", r))
            self._cv.notify_all()

    def cancel(self, r: Request) -> None:
        """Stop a request before the next dispatch (no-op if it has ended)."""
        with self._cv:
            if r in self._live:
                self._inbox.append(("cancel", r))
                self._cv.notify_all()

    def request_stop(self) -> None:
        """Ask the loop to end after its current dispatch (safe from a signal handler: never blocks long)."""
        with self._cv:
            self.stopping = True
            self._cv.notify_all()

    def stop(self, timeout: float = 60.0) -> None:
        """End the loop after its current dispatch; every request still live ends with an error."""
        self.request_stop()
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.thread.join(timeout)
        self._end_all("the server is shutting down")

    # ---- the loop ---------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._inbox and self.engine.idle and not self.stopping:
                        self._cv.wait()
                    if self.stopping:
                        return
                    work, self._inbox = self._inbox, []
                for kind, r in work:
                    if kind == "submit":
                        self.engine.enqueue(r)
                    else:
                        self.engine.cancel(r)
                if not self.engine.idle:
                    self.engine.step()
                self._tell_ended()
                if self.on_step is not None:
                    self.on_step(self.engine)
        except BaseException as e:  # noqa: BLE001 - the engine cannot go on: say so, end every request
            reason = f"the engine failed: {type(e).__name__}: {e}".splitlines()[0]
            traceback.print_exc(file=sys.stderr)
            with self._cv:
                self.error = reason
            self._end_all(reason)
            if self.on_fatal is not None:
                self.on_fatal(reason)
        finally:
            if self.error is None:
                self._end_all("the server is shutting down")

    def _tell_ended(self) -> None:
        with self._cv:
            ended = [r for r in self._live if r.finished]
            self._live.difference_update(ended)
        for r in ended:
            self._notify(r)

    def _end_all(self, reason: str) -> None:
        """Every live request ends now with `reason` (the engine is gone or going)."""
        with self._cv:
            live, self._live = list(self._live), set()
            self._inbox = []
        for r in live:
            if not r.finished:
                r.finish_reason, r.error = "error", reason
            self._notify(r)

    def _notify(self, r: Request) -> None:
        if self.on_ended is not None:
            self.on_ended(r)
        if r.on_done is not None:
            try:
                r.on_done()
            except Exception:  # noqa: BLE001 - a waiter that has gone away concerns no one else
                pass
