"""``ModelWorker``: model compute off the event loop, on one dedicated thread per runtime.

Health checks and other calls keep answering during a forward, and the runtime is never entered
twice (calls run one at a time, in submission order). Plain asyncio, no gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from specdec.service_errors import ShuttingDownError

log = logging.getLogger(__name__)


class ModelWorker:
    """One thread that runs every call into a model runtime, in submission order.

    ``await worker.run(fn, *args)`` runs ``fn(*args)`` on that thread; the event loop stays free
    (health checks answer during a forward), and the runtime never sees two calls at once.
    """

    def __init__(self, name: str):
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.closed = False

    async def run(self, fn: Callable, *args):
        """Raises ShuttingDownError after ``close``."""
        if self.closed:
            raise ShuttingDownError("the server is shutting down")
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def submit(self, fn: Callable, *args) -> None:
        """Fire and forget (e.g. a release from a cancelled stream); errors are logged."""
        def report(future):
            if not future.cancelled() and future.exception() is not None:
                log.error("%s failed: %s", getattr(fn, "__name__", fn), future.exception())

        if not self.closed:  # after close the process is exiting: nothing left to free
            self.executor.submit(fn, *args).add_done_callback(report)

    def close(self) -> None:
        """Finish the call in progress, drop queued ones; later calls raise ShuttingDownError."""
        self.closed = True
        self.executor.shutdown(wait=True, cancel_futures=True)
