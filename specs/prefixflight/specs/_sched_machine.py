"""`SchedulerConformance`: drive a continuous-batching scheduler as its model runner would,
and check every step's KV reads, its pages and its outputs.

A scheduler joins through an adapter (the `SchedulerAdapter` protocol: add, abort,
schedule, complete, pages) that declares its `SchedulerSemantics`::

    from hypothesis.stateful import run_state_machine_as_test
    from prefixflight.specs import SchedulerConformance

    run_state_machine_as_test(SchedulerConformance.for_adapter(MySchedulerAdapter))

``MySchedulerAdapter(limits)`` builds a fresh scheduler for a `SchedulerLimits` (block size,
pages, batch limits, policy). The machine plays the model runner: requests of real token
ids sharing prefixes arrive, are aborted (also while their step runs) and run step by step
on pages that hold, per position, the exact sequence whose KV was computed there, and it
samples each next token as a function of the sequence (so identical prompts decode alike
and share their decode blocks). After every step it checks:

- every row's context ``[0, start)`` is in its pages, computed for exactly this sequence,
  by an earlier step or, as ``same_step_reads`` declares, by another row of this step (all
  rows write before any attends, or only declared writers); no page has two writers;
- rows are consistent: live requests only, each at most once, the tokens the request has at
  those positions, a sample exactly when the row ends its known tokens, a first row starting
  at a block boundary (hits are whole blocks, at most ``num_tokens - 1`` tokens), the
  runner's page table equal to the pages the scheduler holds for it, the batch limits, and
  chunks cut only when the budget runs out (``chunking="budget"``); without preemption,
  every decoding request decodes in every step;
- page accounting: no page free and held at once (nothing in use freed), every page free or
  held (nothing leaked), no pages held by an ended request, reference counts equal the
  holders (when the adapter reports them), every cached block's page holding exactly that
  block's KV (``publish="at-schedule"``: or written by the step being run);
- outputs: every sampled token of a live request is delivered in that step, in order, and
  nothing else; a request finishes exactly when it samples a stop token or its last token;
- liveness: with arrivals stopped, everything finishes within a bound of steps, and then no
  page is held.

Prompts are chains of chunks (one block each) from a four-letter alphabet, plus a partial
tail: ``a.b+3c`` is two full blocks and 3 tokens of chunk ``c``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from hypothesis import note as _hypothesis_note
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixflight.core import UsageError

from ._adapter import ALPHABET, NO_OP, chunk_tokens, configs_of, label, name_of, semantics_of
from ._declare import SchedulerSemantics
from ._sched_adapter import Delivery, ScheduledRow, SchedulerLimits, SchedulerPages
from ._strategies import draw_supported
from .adapters._prefixflight import PrefixflightSchedulerAdapter

__all__ = ["SchedulerConformance", "sampled_token"]

_MAX_CHUNKS = 4  # whole blocks in a prompt, at most
_MAX_NEW = 8
_MAX_LIVE = 6
_STOP = 3

# one slot per position of a page: the sequence (prefix) whose KV it holds, who wrote it, when
_Slot = tuple[tuple[int, ...], str, int]


def note(text: str) -> None:
    """Hypothesis' ``note``, and nothing outside a test (a sequence replayed by hand)."""
    with contextlib.suppress(InvalidArgument):
        _hypothesis_note(text)


def sampled_token(sequence: Sequence[int]) -> int:
    """The token the machine's runner samples after ``sequence`` (a function of the
    sequence only: identical prompts decode alike)."""
    return (sequence[-1] + len(sequence)) % 4


def _limits(machine: type[SchedulerConformance]) -> st.SearchStrategy[SchedulerLimits]:
    """The limits a scheduler is built with: block size, pages, batch bounds, policy."""

    @st.composite
    def limits(draw: st.DrawFn) -> SchedulerLimits:
        bs = draw(machine.block_sizes, label="block_size")
        max_running = draw(st.integers(1, 4), label="max_running")
        return SchedulerLimits(
            block_size=bs,
            pages=draw(st.integers(2, _max_pages(bs)), label="pages"),
            max_running=max_running,
            max_batch_tokens=draw(st.integers(max_running, 3 * bs), label="max_batch_tokens"),
            policy=draw(st.sampled_from(sorted(machine.semantics.policies)), label="policy"),
        )

    return limits()


def _max_pages(block_size: int) -> int:
    """Pages the longest request needs alone (every position it computes), and two more."""
    positions = _MAX_CHUNKS * block_size + block_size - 1 + _MAX_NEW - 1
    return -(-positions // block_size) + 2


class SchedulerConformance(RuleBasedStateMachine):
    """A scheduler driven as its model runner would drive it, under its declaration.

    As it stands it checks prefixflight's own `Scheduler` (`PrefixflightSchedulerAdapter`);
    `for_adapter` makes the machine for another scheduler.
    """

    factory: ClassVar[Callable[[SchedulerLimits], Any]] = PrefixflightSchedulerAdapter
    semantics: ClassVar[SchedulerSemantics] = PrefixflightSchedulerAdapter.semantics
    block_sizes: ClassVar[st.SearchStrategy[int]] = st.sampled_from([4, 16])

    @classmethod
    def for_adapter(
        cls,
        factory: Callable[[SchedulerLimits], Any],
        *,
        semantics: SchedulerSemantics | None = None,
        block_sizes: st.SearchStrategy[int] | None = None,
    ) -> type[SchedulerConformance]:
        """A machine that checks ``factory(limits)``'s adapters.

        ``semantics`` defaults to ``factory.semantics`` (through `functools.partial`);
        ``block_sizes`` narrows the block sizes drawn (default 4 or 16 tokens). ``factory``
        may raise `Unsupported` for limits it does not take: the example is discarded.
        """
        declared = semantics or semantics_of(factory) or SchedulerSemantics()
        if not isinstance(declared, SchedulerSemantics):
            raise UsageError(f"semantics must be a SchedulerSemantics, got {declared!r}")
        body: dict[str, Any] = {"factory": staticmethod(factory), "semantics": declared}
        block_sizes = block_sizes if block_sizes is not None else configs_of(factory)
        if block_sizes is not None:
            body["block_sizes"] = block_sizes
        return type(f"{cls.__name__}_{name_of(factory)}", (cls,), body)

    def __init__(self) -> None:
        super().__init__()
        self.sched: Any = None
        self.limits = SchedulerLimits(block_size=1, pages=0, max_running=1, max_batch_tokens=1)
        self.slots: list[list[_Slot | None]] = []
        self.seqs: dict[str, list[int]] = {}  # every request: prompt, then sampled tokens
        self.prompt_len: dict[str, int] = {}
        self.max_new: dict[str, int] = {}
        self.stops: dict[str, bool] = {}
        self.live: set[str] = set()  # added and not ended
        self.ended: dict[str, str] = {}  # rid -> "aborted", "stop" or "length"
        self.decoding: set[str] = set()  # live requests whose first token is out
        self.seen: set[str] = set()  # requests that had a row
        self.rows: list[ScheduledRow] | None = None  # the outstanding step's rows
        self.sampled: dict[str, int] = {}
        self.step_no = 0
        self.next_id = 0
        self.at = "start"

    # -- set-up --------------------------------------------------------------------------
    @initialize(data=st.data())
    def start(self, data: st.DataObject) -> None:
        draw_supported(data, _limits(type(self)), self._begin, label="limits")

    def _begin(self, limits: SchedulerLimits) -> None:
        """A fresh scheduler for ``limits`` (the rules' helpers ``_add``, ``_schedule``,
        ``_complete`` and ``_abort`` replay a sequence by hand)."""
        self.sched = type(self).factory(limits)
        self.limits = limits
        self.slots = [[None] * limits.block_size for _ in range(limits.pages)]
        self.at = f"start({limits!r})"
        note(self.at)

    def teardown(self) -> None:
        close = getattr(self.sched, "close", None)
        if callable(close):
            close()

    # -- naming ----------------------------------------------------------------------------
    def _name(self, rid: str) -> str:
        return f"{rid} ({label(self.seqs[rid][: self.prompt_len[rid]], self.limits.block_size)})"

    # -- rules ---------------------------------------------------------------------------
    @precondition(lambda self: self.sched is not None and len(self.live) < _MAX_LIVE)
    @rule(
        first=st.integers(0, 1),  # prompts often share their first block (a system prompt)
        chunks=st.lists(st.integers(0, len(ALPHABET) - 1), max_size=_MAX_CHUNKS - 1),
        tail=st.integers(0, len(ALPHABET) - 1),
        tail_len=st.integers(0, 15),
        whole=st.integers(0, 3),
        max_new=st.integers(1, _MAX_NEW),
        stop=st.booleans(),
        priority=st.integers(0, 2),
    )
    def add(
        self,
        first: int,
        chunks: list[int],
        tail: int,
        tail_len: int,
        whole: int,
        max_new: int,
        stop: bool,
        priority: int,
    ) -> None:
        """A prompt: ``first`` and ``chunks`` (no full block when ``whole`` is 0), then
        ``tail_len`` tokens of chunk ``tail``."""
        bs = self.limits.block_size
        blocks = [first, *chunks] if whole else []
        tail_len %= bs
        if not blocks and tail_len == 0:
            tail_len = 1
        tokens = [t for c in blocks for t in chunk_tokens(c, bs)]
        tokens += chunk_tokens(tail, bs)[:tail_len]
        self._add(tokens, max_new, stop, priority)

    @precondition(lambda self: bool(self.live) and len(self.live) < _MAX_LIVE)
    @rule(
        data=st.data(),
        copies=st.integers(1, 3),
        max_new=st.integers(1, _MAX_NEW),
        priority=st.integers(0, 2),
    )
    def add_identical(self, data: st.DataObject, copies: int, max_new: int, priority: int) -> None:
        """A burst of requests with the same prompt as a live one: they may share pages
        written in the same step."""
        other = data.draw(st.sampled_from(sorted(self.live)), label="same prompt as")
        prompt = self.seqs[other][: self.prompt_len[other]]
        for _ in range(min(copies, _MAX_LIVE - len(self.live))):
            self._add(prompt, max_new, self.stops[other], priority)

    def _add(self, tokens: list[int], max_new: int, stop: bool, priority: int) -> None:
        # every request fits the pool alone: its positions (the last sample is never
        # computed) cover at most every page
        room = self.limits.pages * self.limits.block_size
        tokens = tokens[: room + 1 - max_new] or tokens[:1]
        max_new = min(max_new, room + 1 - len(tokens))
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.seqs[rid] = list(tokens)
        self.prompt_len[rid] = len(tokens)
        self.max_new[rid] = max_new
        self.stops[rid] = stop
        self.at = (
            f"add({self._name(rid)}, max_new_tokens={max_new}"
            f"{', stop' if stop else ''}{f', priority={priority}' if priority else ''})"
        )
        note(self.at)
        self.sched.add(
            rid,
            list(tokens),
            max_new_tokens=max_new,
            stop_token_ids=(_STOP,) if stop else (),
            priority=priority,
        )
        self.live.add(rid)

    @precondition(lambda self: self.sched is not None and self.rows is None)
    @rule()
    def step(self) -> None:
        """Schedule a step, run it and report its result."""
        self._schedule()
        if self.rows is not None:
            self._complete()

    @precondition(lambda self: self.sched is not None and self.rows is None)
    @rule()
    def schedule(self) -> None:
        """Schedule and run a step; its result comes later (aborts may come in between)."""
        self._schedule()

    @precondition(lambda self: self.rows is not None)
    @rule()
    def complete(self) -> None:
        self._complete()

    # aborts and drains act on one draw of ``now`` in three, so that they do not crowd out
    # steps and arrivals (Hypothesis picks enabled rules uniformly)
    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), now=st.integers(0, 2), started=st.booleans())
    def abort(self, data: st.DataObject, now: int, started: bool) -> None:
        """A client goes away (``started``: one whose request has run, if any has)."""
        if now:
            note(NO_OP)
            return
        pick = sorted(self.live & self.seen) if started else []
        self._abort(data.draw(st.sampled_from(pick or sorted(self.live)), label="request"))

    def _abort(self, rid: str) -> None:
        running = self.rows is not None and any(r.request_id == rid for r in self.rows)
        self.at = f"abort({rid}{', while its step runs' if running else ''})"
        note(self.at)
        self.sched.abort(rid)
        self.live.discard(rid)
        self.decoding.discard(rid)
        self.ended[rid] = "aborted"

    @precondition(lambda self: self.sched is not None)
    @rule(now=st.integers(0, 2))
    def drain(self, now: int) -> None:
        """Liveness: with arrivals stopped, everything finishes within a bound of steps."""
        if now:
            note(NO_OP)
            return
        if self.rows is not None:
            self._complete()
        redo = 2 if type(self).semantics.preemption == "recompute" else 1
        work = sum(len(self.seqs[r]) + self.max_new[r] for r in self.live)
        bound = redo * work + 2 * len(self.live) + 4
        waiting = sorted(self.live)
        for _ in range(bound):
            if not self.sched.has_unfinished():
                break
            self.check_pages()
            self._schedule()
            assert self.rows is not None, (
                f"{self.at}: an empty step while {sorted(self.live)} are unfinished"
            )
            self._complete()
        assert not self.sched.has_unfinished(), (
            f"after {bound} steps with no arrivals, {sorted(self.live)} are still unfinished "
            f"(of {waiting})"
        )
        assert not self.live, (
            f"the scheduler has nothing unfinished, but {sorted(self.live)} never finished"
        )
        view = self.sched.pages()
        assert not view.held, f"with no request left, pages are held: {dict(view.held)}"
        every = frozenset(range(self.limits.pages))
        assert view.free == every, (
            f"with no request left, pages {sorted(every - view.free)} are not free"
        )

    # -- one step ------------------------------------------------------------------------
    def _schedule(self) -> None:
        rows = list(self.sched.schedule())
        self.step_no += 1
        desc = ", ".join(
            f"{r.request_id}[{r.start}:{r.end}]{'*' if r.sample else ''}" for r in rows
        )
        self.at = f"step {self.step_no} ({desc or 'empty'})"
        note(f"{self.at} pages {[list(r.pages) for r in rows]}")
        if not rows:
            self.rows = None
            assert not self.decoding or type(self).semantics.preemption != "none", (
                f"{self.at}: an empty step while {sorted(self.decoding)} are decoding"
            )
            return
        view = self.sched.pages()
        self._check_rows(rows, view)
        writers = self._writers(rows)
        self._check_same_step(rows, writers)
        self._check_cached(view, writers)
        self._run(rows)
        self.rows = rows
        self.sampled = {
            r.request_id: sampled_token(self.seqs[r.request_id]) for r in rows if r.sample
        }
        self.seen.update(r.request_id for r in rows)

    def _check_rows(self, rows: list[ScheduledRow], view: SchedulerPages) -> None:
        sem, lim, bs, at = type(self).semantics, self.limits, self.limits.block_size, self.at
        ids = [r.request_id for r in rows]
        assert len(ids) == len(set(ids)), f"{at}: a request has two rows"
        assert len(rows) <= lim.max_running, (
            f"{at}: {len(rows)} rows, max_running {lim.max_running}"
        )
        total = sum(len(r.token_ids) for r in rows)
        assert total <= lim.max_batch_tokens, (
            f"{at}: {total} tokens, max_batch_tokens {lim.max_batch_tokens}"
        )
        for r in rows:
            rid = r.request_id
            assert rid in self.seqs, f"{at}: a row for {rid!r}, which was never added"
            assert rid not in self.ended, f"{at}: {self._name(rid)} runs after it {self.ended[rid]}"
            seq = self.seqs[rid]
            assert r.token_ids, f"{at}: {rid}'s row computes no token"
            assert r.start >= 0 and r.end <= len(seq), (
                f"{at}: {rid} computes positions [{r.start}, {r.end}) of a {len(seq)}-token "
                "sequence"
            )
            assert r.token_ids == tuple(seq[r.start : r.end]), (
                f"{at}: {rid} computes {list(r.token_ids)} at positions [{r.start}, {r.end}), "
                f"its tokens there are {seq[r.start : r.end]}"
            )
            assert r.sample == (r.end == len(seq)), (
                f"{at}: {rid} {'samples' if r.sample else 'does not sample'} after position "
                f"{r.end - 1} of its {len(seq)} tokens"
            )
            if rid not in self.seen:
                assert r.start % bs == 0, (
                    f"{at}: {self._name(rid)} reuses {r.start} tokens, not whole blocks"
                )
            assert len(r.pages) * bs >= r.end, (
                f"{at}: {rid}'s {len(r.pages)} pages do not cover positions [0, {r.end})"
            )
            held = tuple(view.held.get(rid, ()))
            assert held[: len(r.pages)] == r.pages, (
                f"{at}: the runner's page table of {rid} is {list(r.pages)}, the scheduler "
                f"holds {list(held)} for it"
            )
        if sem.preemption == "none":
            skipped = self.decoding - set(ids)
            assert not skipped, f"{at}: decoding {sorted(skipped)} skipped a step"
        if sem.chunking == "budget":
            for r in rows:
                assert r.sample or total == lim.max_batch_tokens, (
                    f"{at}: {self._name(r.request_id)} is cut at position {r.end} with "
                    f"{lim.max_batch_tokens - total} tokens of budget left"
                )

    def _writers(self, rows: list[ScheduledRow]) -> dict[int, str]:
        """The pages the step writes -> the request writing each; no page has two writers."""
        bs = self.limits.block_size
        out: dict[int, str] = {}
        for r in rows:
            for j in range(r.start // bs, -(-r.end // bs)):
                owner = out.setdefault(r.pages[j], r.request_id)
                assert owner == r.request_id, (
                    f"{self.at}: page {r.pages[j]} is written by {owner} and {r.request_id}"
                )
        return out

    def _check_same_step(self, rows: list[ScheduledRow], writers: dict[int, str]) -> None:
        """A page written by this step is in another row's table only as a context page it
        may read in the same step (``same_step_reads``)."""
        mode, bs = type(self).semantics.same_step_reads, self.limits.block_size
        earlier: set[str] = set()
        for r in rows:
            rid = r.request_id
            if r.reads_from:
                assert mode == "declared", (
                    f"{self.at}: {rid} reads pages {list(r.reads_from)} write in this same "
                    f"step (its reads_from), but same_step_reads={mode!r}"
                )
                late = [w for w in r.reads_from if w not in earlier]
                assert not late, f"{self.at}: {rid} reads from {late}, not earlier rows"
            context = -(-r.start // bs)
            for j, page in enumerate(r.pages):
                owner = writers.get(page, rid)
                if owner == rid:
                    continue
                where = f"{self.at}: page {page}, written by {owner} in this step,"
                assert j < context, f"{where} is in {rid}'s page table past its context"
                assert mode != "none", (
                    f"{where} is read by {rid} in the same step, but same_step_reads='none'"
                )
                assert mode == "any" or owner in r.reads_from, (
                    f"{where} is read by {rid}, whose reads_from is {list(r.reads_from)}"
                )
            earlier.add(rid)

    def _run(self, rows: list[ScheduledRow]) -> None:
        """Write each row's KV and check each row's context: all writes first when any row
        may read this step's pages, else row by row in order."""
        if type(self).semantics.same_step_reads == "any":
            for r in rows:
                self._write(r)
            for r in rows:
                self._read(r)
        else:
            for r in rows:
                self._read(r)
                self._write(r)

    def _write(self, r: ScheduledRow) -> None:
        seq, bs = self.seqs[r.request_id], self.limits.block_size
        for p in range(r.start, r.end):
            self.slots[r.pages[p // bs]][p % bs] = (tuple(seq[: p + 1]), r.request_id, self.step_no)

    def _read(self, r: ScheduledRow) -> None:
        seq, bs = self.seqs[r.request_id], self.limits.block_size
        for p in range(r.start):
            page = r.pages[p // bs]
            got = self.slots[page][p % bs]
            if got is None or got[0] != tuple(seq[: p + 1]):
                held = "nothing" if got is None else self._slot(got, p)
                raise AssertionError(
                    f"{self.at}: {self._name(r.request_id)} attends to position {p} in page "
                    f"{page}, which holds {held}, not the KV of its own token {seq[p]}"
                )

    def _slot(self, slot: _Slot, position: int) -> str:
        prefix, writer, step = slot
        what = f"token {prefix[-1]} at position {len(prefix) - 1}"
        if len(prefix) - 1 == position:
            what += f" after {label(prefix[:-1], self.limits.block_size) or 'nothing'}"
        return f"the KV of {what}, written by {writer} in step {step}"

    def _check_cached(self, view: SchedulerPages, writers: dict[int, str] | None) -> None:
        """Every cached block's page holds that block's KV, or (``publish="at-schedule"``,
        before the step runs) this step writes it."""
        bs = self.limits.block_size
        early = type(self).semantics.publish == "at-schedule" and writers is not None
        for page, key in view.cached.items():
            assert key and len(key) % bs == 0, (
                f"{self.at}: page {page} caches a {len(key)}-token key"
            )
            assert 0 <= page < self.limits.pages, f"{self.at}: page {page} does not exist"
            name = label(key, bs)
            if writers is not None and page in writers:
                assert early, (
                    f"{self.at}: page {page} caches {name} before the step writing it has run"
                )
                continue
            for i, slot in enumerate(self.slots[page]):
                pos = len(key) - bs + i
                if slot is None or slot[0] != key[: pos + 1]:
                    held = "nothing" if slot is None else self._slot(slot, pos)
                    raise AssertionError(
                        f"{self.at}: page {page} caches block {name}, but its position {pos} "
                        f"holds {held}"
                    )

    def _complete(self) -> None:
        assert self.rows is not None
        sampled = self.sampled
        self.at = f"complete step {self.step_no} (sampled {sampled})"
        deliveries: list[Delivery] = list(self.sched.complete(dict(sampled)))
        note(f"{self.at} -> {deliveries}")
        self.rows = None
        got: dict[str, Delivery] = {}
        for d in deliveries:
            rid = d.request_id
            assert rid not in got, f"{self.at}: {rid} got two deliveries"
            got[rid] = d
            assert rid in self.live, (
                f"{self.at}: {rid} got {list(d.token_ids)} after it "
                f"{self.ended.get(rid, 'was never added')}"
            )
            assert rid in sampled, f"{self.at}: {rid} got {list(d.token_ids)}, it sampled nothing"
        for rid, tok in sampled.items():
            if rid not in self.live:
                continue
            seq = self.seqs[rid]
            seq.append(tok)
            out = got.get(rid)
            assert out is not None, (
                f"{self.at}: {self._name(rid)} sampled {tok}, nothing was delivered"
            )
            assert out.token_ids == (tok,), (
                f"{self.at}: {rid} sampled {tok}, the scheduler delivered {list(out.token_ids)}"
            )
            outputs = seq[self.prompt_len[rid] :]
            stopped = self.stops[rid] and tok == _STOP
            full = len(outputs) >= self.max_new[rid]
            want = "stop" if stopped else "length" if full else None  # a stop token wins
            assert out.finished == want, (
                f"{self.at}: {self._name(rid)} delivered {outputs} of at most "
                f"{self.max_new[rid]}{' (stop token 3)' if self.stops[rid] else ''}: it should "
                f"{f'finish ({want})' if want else 'go on'}, the scheduler says "
                f"{out.finished or 'go on'}"
            )
            if want is None:
                self.decoding.add(rid)
            else:
                self.live.discard(rid)
                self.decoding.discard(rid)
                self.ended[rid] = f"finished ({want})"
        self.sampled = {}

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def check_pages(self) -> None:
        if self.sched is None:
            return
        view = self.sched.pages()
        at, every = self.at, frozenset(range(self.limits.pages))
        running = {r.request_id for r in self.rows or ()}
        holders: dict[int, list[str]] = {}
        for rid, pages in view.held.items():
            if rid not in self.live:  # an abort during its step may keep pages until it ends
                assert rid in running and self.ended.get(rid) == "aborted", (
                    f"after {at}: {rid}, which {self.ended.get(rid, 'was never added')}, still "
                    f"holds pages {list(pages)}"
                )
            assert len(set(pages)) == len(pages), f"after {at}: {rid} holds {list(pages)}"
            for p in pages:
                holders.setdefault(p, []).append(rid)
        used = frozenset(holders)
        assert used <= every and view.free <= every, (
            f"after {at}: pages outside 0..{len(every) - 1}"
        )
        if view.refs is not None:
            for p in sorted(every):
                got, want = view.refs.get(p, 0), len(holders.get(p, ()))
                assert got == want, (
                    f"after {at}: page {p} has reference count {got}, but {want} requests hold "
                    f"it {holders.get(p, [])}: "
                    + ("a reference leaked" if got > want else "freed while in use")
                )
        both = view.free & used
        assert not both, (
            f"after {at}: pages {sorted(both)} are free while held by "
            f"{sorted({r for p in both for r in holders[p]})}: freed while in use"
        )
        leaked = every - view.free - used
        assert not leaked, f"after {at}: pages {sorted(leaked)} are neither free nor held: leaked"
        self._check_cached(view, None)
        if self.rows is None:
            assert self.sched.has_unfinished() == bool(self.live), (
                f"after {at}: the scheduler says {'some' if self.sched.has_unfinished() else 'no'} "
                f"requests are unfinished; live: {sorted(self.live)}"
            )
