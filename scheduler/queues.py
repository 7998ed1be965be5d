"""Waiting queues: FCFS and priority.

Both keep the same small interface so the scheduler never branches on the
policy: ``add`` (new arrival), ``prepend`` (a preempted or skipped request that
must go before new arrivals), ``peek``/``pop``, ``remove``, ``len``, ``iter``.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Iterator

from tandem.scheduler.request import Request


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def prepend_all(self, requests: Iterable[Request]) -> None:
        self._q.extendleft(reversed(list(requests)))

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)

    def __len__(self) -> int:
        return len(self._q)

    def __bool__(self) -> bool:
        return bool(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityQueue:
    """Lowest ``priority`` value first, then earliest arrival (``Request.__lt__``).

    ``prepend`` is the same as ``add``: order is decided by priority alone.
    """

    def __init__(self) -> None:
        self._heap: list[Request] = []

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, request)

    prepend = add

    def prepend_all(self, requests: Iterable[Request]) -> None:
        for r in requests:
            heapq.heappush(self._heap, r)

    def peek(self) -> Request:
        return self._heap[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)

    def remove(self, request: Request) -> None:
        self._heap.remove(request)
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter(sorted(self._heap))


QUEUES = {"fcfs": FCFSQueue, "priority": PriorityQueue}


def create_queue(policy: str) -> FCFSQueue | PriorityQueue:
    try:
        return QUEUES[policy]()
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(QUEUES)}, got {policy!r}") from None
