"""`FakeBackend`: a development backend that runs step plans instantly, without a model.

Its pages hold token ids instead of KV, and every read is checked: a prefill or decode may
only attend to pages that hold exactly the tokens of its own sequence, and no page written
in a step is used by another request in that step. Use it to develop a host loop around a
`Scheduler` before a model is wired in; `SchedulerMachine` uses it to check the scheduler.
It needs only ``prefixflight.core`` (importing it does not import Hypothesis)::

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
    ``sampler(rid, position)`` picks the token sampled after ``position``.
    """

    def __init__(
        self, num_pages: int, block_size: int, sampler: Callable[[RequestId, int], int]
    ) -> None:
        self.block_size = block_size
        self.pages: list[list[int | None]] = [[None] * block_size for _ in range(num_pages)]
        self.sequences: dict[RequestId, list[int]] = {}
        self.sampler = sampler

    def _read(self, pages: tuple[int, ...], pos: int) -> int | None:
        return self.pages[pages[pos // self.block_size]][pos % self.block_size]

    def _write(self, pages: tuple[int, ...], pos: int, token: int) -> None:
        self.pages[pages[pos // self.block_size]][pos % self.block_size] = token

    def _check_context(self, rid: RequestId, pages: tuple[int, ...], end: int) -> None:
        seq = self.sequences[rid]
        for pos in range(end):
            got = self._read(pages, pos)
            assert got == seq[pos], f"{rid!r} position {pos}: page holds {got!r}, not {seq[pos]}"

    def run(self, plan: StepPlan) -> StepResult:
        bs = self.block_size
        written: dict[int, RequestId] = {}
        for p in plan.prefills:
            for pos in range(p.start, p.start + len(p.token_ids)):
                written.setdefault(p.pages[pos // bs], p.request_id)
        for d in plan.decodes:
            written.setdefault(d.pages[d.position // bs], d.request_id)
        works = [(p.request_id, p.pages) for p in plan.prefills]
        works += [(d.request_id, d.pages) for d in plan.decodes]
        for rid, pages in works:
            for page in pages:
                owner = written.get(page, rid)
                assert owner == rid, f"page {page} written by {owner!r} is also used by {rid!r}"
        sampled: list[tuple[RequestId, int]] = []
        for p in plan.prefills:
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
