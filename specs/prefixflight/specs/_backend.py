"""`FakeBackend`: a development backend that runs step plans instantly, without a model.

Its pages hold token ids instead of KV, and every read is checked: a prefill or decode may
only attend to pages that hold exactly the tokens of its own sequence, and a page written in
a step is used by no other request of that step, except as same-step sharing declares it: a
prefill's `PrefillWork.reads_from` names the earlier prefills of the plan that write some of
its context pages. The rows run one at a time in plan order, each reading its context and
then writing its own positions, so a declared read finds exactly what its writer wrote in
that step and any other read finds what earlier steps computed: a plan that reads a page
before its KV is computed fails here. Use it to develop a host loop around a `Scheduler`
before a model is wired in; `SchedulerMachine` uses it to check the scheduler. It needs only
``prefixflight.core`` (importing it does not import Hypothesis)::

    from prefixflight.specs import FakeBackend

    backend = FakeBackend(num_pages, block_size, sampler=lambda rid, pos: 7)
    backend.sequences[rid] = list(prompt)  # before the request's first step
    result = backend.run(scheduler.schedule(now))
    scheduler.complete_step(result, now)
"""

from __future__ import annotations

from collections.abc import Callable

from prefixflight.core import RequestId, StepPlan, StepResult

__all__ = ["FakeBackend"]


class FakeBackend:
    """Runs plans instantly; pages hold token ids; every read is checked.

    ``sequences[rid]`` is the host's view of each request (prompt, then sampled tokens);
    ``sampler(rid, position)`` picks the token sampled after ``position``. `written` holds,
    after each `run`, the pages that step wrote and the request that wrote each.
    """

    def __init__(
        self, num_pages: int, block_size: int, sampler: Callable[[RequestId, int], int]
    ) -> None:
        self.block_size = block_size
        self.pages: list[list[int | None]] = [[None] * block_size for _ in range(num_pages)]
        self.sequences: dict[RequestId, list[int]] = {}
        self.sampler = sampler
        self.written: dict[int, RequestId] = {}

    def _read(self, pages: tuple[int, ...], pos: int) -> int | None:
        return self.pages[pages[pos // self.block_size]][pos % self.block_size]

    def _write(self, pages: tuple[int, ...], pos: int, token: int) -> None:
        self.pages[pages[pos // self.block_size]][pos % self.block_size] = token

    def _check_context(self, rid: RequestId, pages: tuple[int, ...], end: int) -> None:
        seq = self.sequences[rid]
        for pos in range(end):
            got = self._read(pages, pos)
            assert got == seq[pos], f"{rid!r} position {pos}: page holds {got!r}, not {seq[pos]}"

    def writers(self, plan: StepPlan) -> dict[int, RequestId]:
        """The pages ``plan`` writes and the request writing each; no page has two writers."""
        bs = self.block_size
        out: dict[int, RequestId] = {}
        spans = [
            (p.request_id, p.pages, p.start, p.start + len(p.token_ids)) for p in plan.prefills
        ]
        spans += [(d.request_id, d.pages, d.position, d.position + 1) for d in plan.decodes]
        for rid, pages, start, end in spans:
            for j in range(start // bs, -(-end // bs)):
                owner = out.setdefault(pages[j], rid)
                assert owner == rid, f"page {pages[j]} is written by {owner!r} and {rid!r}"
        return out

    def check_reads(self, plan: StepPlan, writers: dict[int, RequestId]) -> None:
        """A page written by this step is used by another request only as a prefill's
        context page from a writer its ``reads_from`` names (an earlier prefill)."""
        bs = self.block_size
        earlier: set[RequestId] = set()
        for p in plan.prefills:
            rid = p.request_id
            for w in p.reads_from:
                assert w in earlier, f"{rid!r} reads from {w!r}, not an earlier prefill"
            context = -(-p.start // bs)
            for j, page in enumerate(p.pages):
                owner = writers.get(page, rid)
                assert owner == rid or (j < context and owner in p.reads_from), (
                    f"page {page} written by {owner!r} in step {plan.step} is also used by "
                    f"{rid!r} (reads_from {p.reads_from!r})"
                )
            earlier.add(rid)
        for d in plan.decodes:
            for page in d.pages:
                owner = writers.get(page, d.request_id)
                assert owner == d.request_id, (
                    f"page {page} written by {owner!r} is also used by {d.request_id!r}"
                )

    def run(self, plan: StepPlan) -> StepResult:
        writers = self.writers(plan)
        self.check_reads(plan, writers)
        self.written = writers
        sampled: list[tuple[RequestId, int]] = []
        for p in plan.prefills:  # in plan order: a row's writers ran before it
            seq = self.sequences[p.request_id]
            self._check_context(p.request_id, p.pages, p.start)
            assert list(p.token_ids) == seq[p.start : p.start + len(p.token_ids)]
            for i, tok in enumerate(p.token_ids):
                self._write(p.pages, p.start + i, tok)
            if p.sample:
                end = p.start + len(p.token_ids)
                assert end == len(seq), "sample=True must end the prompt"
                tok = self.sampler(p.request_id, end)
                seq.append(tok)
                sampled.append((p.request_id, tok))
        for d in plan.decodes:
            seq = self.sequences[d.request_id]
            assert d.position == len(seq) - 1 and d.token_id == seq[-1]
            self._check_context(d.request_id, d.pages, d.position)
            self._write(d.pages, d.position, d.token_id)
            tok = self.sampler(d.request_id, d.position + 1)
            seq.append(tok)
            sampled.append((d.request_id, tok))
        return StepResult(step=plan.step, sampled=tuple(sampled))
