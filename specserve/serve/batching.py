"""Continuous batching for a pool replica.

Calls wait in a queue; whenever the worker is free, everything queued (up to max_batch_size)
becomes the next forward pass. Unlike `serve.batch`, which closes each batch when its wait
window ends and then queues finished batches behind the running one, a batch here is formed
only when it can run, so every call that arrived during the previous pass joins the next.

A batch may answer RUN_AGAIN for a call it only advanced (a chunk of a long prompt): that call
goes back to the front of the queue and joins the next pass with whatever arrived meanwhile.
"""

from __future__ import annotations

import asyncio
from typing import Callable

RUN_AGAIN = object()  # a batch result: not finished, run this call again in the next pass


class ContinuousBatcher:
    def __init__(self, run_batch: Callable[[list], list], *, max_batch_size: int, wait_s: float = 0.0):
        self.run_batch = run_batch  # blocking: runs in a thread, returns one result per item
        self.max_batch_size = max_batch_size
        self.wait_s = wait_s
        self._queue: list[tuple[object, asyncio.Future]] = []
        self._worker: asyncio.Task | None = None

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def submit(self, item):
        future = asyncio.get_running_loop().create_future()
        self._queue.append((item, future))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        while self._queue:
            if self.wait_s and len(self._queue) < self.max_batch_size:
                await asyncio.sleep(self.wait_s)  # let calls that are already on their way join
            batch = [(i, f) for i, f in self._queue[: self.max_batch_size] if not f.cancelled()]
            del self._queue[: self.max_batch_size]
            if batch:
                await self._run(batch)

    async def _run(self, batch) -> None:
        try:
            results = await asyncio.to_thread(self.run_batch, [item for item, _ in batch])
        except Exception as exc:
            if len(batch) > 1:  # isolate the failing call: the others must not fail with it
                for one in batch:
                    await self._run([one])
            elif not batch[0][1].done():
                batch[0][1].set_exception(exc)
            return
        again = [(item, future) for (item, future), result in zip(batch, results)
                 if result is RUN_AGAIN and not future.done()]
        self._queue[:0] = again  # ahead of later arrivals, in their order
        for (_, future), result in zip(batch, results):
            if result is not RUN_AGAIN and not future.done():
                future.set_result(result)
