"""Join the KV connector outputs of every tensor-parallel rank into the engine's.

Each rank moves its own shard of a request's KV, so the request is done
sending (or receiving) only when every rank said so; a block whose load
failed on any rank is invalid for the engine::

    step k   rank 0: recving {a}      rank 1: {}        -> engine: {}
    step k+1 rank 0: {}               rank 1: {a}       -> engine: {a}
    invalid block ids: union, reported at once
"""

from __future__ import annotations

from collections import Counter

from scheduler.messages import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._sending: Counter[str] = Counter()
        self._recving: Counter[str] = Counter()

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """One step's outputs, one per rank (None: nothing to say) -> the engine's."""
        sending = self._complete(self._sending, (o.finished_sending for o in outputs if o))
        recving = self._complete(self._recving, (o.finished_recving for o in outputs if o))
        invalid = sorted({b for o in outputs if o for b in o.invalid_block_ids})
        if not (sending or recving or invalid):
            return None
        return KVConnectorOutput(
            finished_sending=sending, finished_recving=recving, invalid_block_ids=invalid
        )

    def _complete(self, counts: Counter[str], reports) -> list[str]:
        done = []
        for ids in reports:
            for rid in ids:
                counts[rid] += 1
                if counts[rid] == self.num_ranks:
                    del counts[rid]
                    done.append(rid)
        return sorted(done)

    def check_integrity(self) -> None:
        """Idle engine: no rank waits on another for a request."""
        pending = sorted({*self._sending, *self._recving})
        if pending:
            raise AssertionError(f"requests reported done by only some TP ranks: {pending}")
