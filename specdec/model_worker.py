"""``ModelWorker``: model compute off the event loop, on one dedicated thread per runtime (the load too: one OpenMP team
per process, docs/design.md "Speed paths"). Calls run one at a time, in submission order."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import Callable

from specdec.service_errors import ShuttingDownError

log = logging.getLogger(__name__)


class ModelWorker:
    """One daemon thread that runs every call into a model runtime, in submission order: ``await
    worker.run(fn, *args)`` from the event loop, ``worker.call(fn, *args)`` from a thread without one."""

    def __init__(self, name: str):
        self.name = name
        self.closed = False
        self._lock = threading.Lock()  # closed + the queue's end marker, against a submit racing close
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run_one(*item)
            del item  # keep no call's arguments or outcome alive while idle

    def _run_one(self, future: concurrent.futures.Future, fn: Callable, args: tuple) -> None:
        if self.closed:  # queued before close: dropped, never run
            future.cancel()
        elif future.set_running_or_notify_cancel():  # False: its caller has gone
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the caller gets it
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _submit(self, fn: Callable, args: tuple) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.closed:
                raise ShuttingDownError("the server is shutting down")
            self._queue.put((future, fn, args))
        return future

    async def run(self, fn: Callable, *args):
        """Raises ShuttingDownError after ``close``; cancelling the awaiting task drops the call if it
        has not started."""
        return await asyncio.wrap_future(self._submit(fn, args))

    def call(self, fn: Callable, *args):
        """``fn(*args)`` on the worker's thread, waiting for it here (no event loop needed); raises what ``fn`` raises,
        ShuttingDownError after ``close``, or RuntimeError on the worker's own thread (it would wait for itself)."""
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{self.name}: call() from its own thread would wait for itself")
        return self._submit(fn, args).result()

    def submit(self, fn: Callable, *args) -> None:
        """Fire and forget (e.g. a release from a cancelled stream); errors are logged."""
        def report(future):
            if not future.cancelled() and future.exception() is not None:
                log.error("%s failed: %s", getattr(fn, "__name__", fn), future.exception())

        try:
            self._submit(fn, args).add_done_callback(report)
        except ShuttingDownError:  # after close the process is exiting: nothing left to free
            pass

    def busy(self) -> bool:
        """Whether the thread is still running (a call in progress, or calls or the end of ``close`` still queued)."""
        return self._thread.is_alive()

    def close(self, wait: bool = True) -> None:
        """Drop queued calls; later calls raise ShuttingDownError. wait: return once the call in progress has finished
        (False: at once; the process is exiting, e.g. a SIGTERM during the load). Idempotent."""
        with self._lock:
            if not self.closed:
                self.closed = True
                self._queue.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()
