"""One engine's KV connector output from its tensor-parallel ranks' outputs.

Every rank runs its own connector worker side (its own KV shard, NIXL
agent, reads); the engine's one scheduler must see one ``KVConnectorOutput``
per step::

    finished_recving   a request once EVERY rank reported it (each rank
                       reads its own heads; the KV is whole only then)
    invalid_block_ids  the union of what the ranks reported with their
                       finish of that request, handed over with the request
                       (the scheduler only reads them in that step)
    finished_sending   the lead rank's (rank 0 holds a prefill engine's sends
                       and counts every decode rank's "done"; other ranks
                       never report sends)

Used by the engine's rank-0 side after collecting every rank's step output.
"""

from __future__ import annotations

from tandem.scheduler.messages import KVConnectorOutput


class ConnectorOutputMerger:
    """Stateful across steps: a request some ranks finished waits for the rest."""

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        # request id -> (ranks that finished it, invalid blocks they reported)
        self._recving: dict[str, tuple[set[int], set[int]]] = {}

    def merge(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """``outputs[r]``: rank r's output of this step (None: nothing)."""
        if len(outputs) != self.num_ranks:
            raise ValueError(f"{len(outputs)} outputs for {self.num_ranks} ranks")
        finished: list[str] = []
        invalid: set[int] = set()
        for rank, out in enumerate(outputs):
            if out is None:
                continue
            for request_id in out.finished_recving:
                ranks, blocks = self._recving.setdefault(request_id, (set(), set()))
                ranks.add(rank)
                # a rank's errors come in the step it finished its loads: they are
                # the blocks of those requests (harmless to others: the scheduler
                # only looks at the finishing request's own blocks)
                blocks.update(out.invalid_block_ids)
                if len(ranks) == self.num_ranks:
                    del self._recving[request_id]
                    finished.append(request_id)
                    invalid |= blocks
        lead = outputs[0]
        sending = list(lead.finished_sending) if lead is not None else []
        if not (finished or sending or invalid):
            return None
        return KVConnectorOutput(
            finished_sending=sending,
            finished_recving=sorted(finished),
            invalid_block_ids=sorted(invalid),
        )

    def check_integrity(self) -> None:
        """Idle engine: no request finished by only some ranks."""
        if self._recving:
            partial = {r: sorted(ranks) for r, (ranks, _) in self._recving.items()}
            raise AssertionError(f"requests received by only some ranks: {partial}")
