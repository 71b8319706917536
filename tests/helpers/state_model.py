"""A plain reference model of the draft server's state (``server/state.py``, ``rows.py``,
``reconnect.py``), written from the rules, for ``test_server_state_machine``.

What each session stores (active requests in activation order, one retained LRU over all
sessions, the handles the server took back) and, per stored context, its pool blocks as
abstract ids: a fork shares its source's full blocks and copies a partial one; a write
into a shared partial block copies it first. Room is judged by the fair-share rules
(``server/share.py``): a table of ``size`` entries is divided among the sessions holding
something and the one asking, by weight; a session within its share takes room back from
those over theirs (retained contexts first, least recent first; then their newest active
requests), never the other way round. Nothing here calls the server's code.
"""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass, field


class Refused(Exception):
    def __init__(self, code: str):
        super().__init__(code)
        self.code = code


@dataclass(eq=False)
class Ctx:
    tokens: list[int]
    blocks: list[int]


@dataclass(eq=False)
class MSession:
    key: str
    weight: int
    active: dict[int, Ctx] = field(default_factory=dict)     # activation order
    evicted: set[int] = field(default_factory=set)
    gave_back: Counter = field(default_factory=Counter)


class StateModel:
    def __init__(self, *, blocks: int, block_rows: int, max_requests: int, max_total: int,
                 max_retained: int, needs_hidden: bool):
        self.n, self.r = blocks, block_rows
        self.max_requests, self.max_total, self.max_retained = max_requests, max_total, max_retained
        self.needs_hidden = needs_hidden
        self.sessions: dict[str, MSession] = {}
        self.retained: OrderedDict[tuple[str, int], Ctx] = OrderedDict()
        self._ids = itertools.count()

    # --------------------------------------------------------------- views
    def open(self, key: str, weight: int) -> None:
        self.sessions.setdefault(key, MSession(key, weight))

    def contexts(self):
        """(session key, handle, where, context) of everything stored."""
        for s in self.sessions.values():
            for h, c in s.active.items():
                yield s.key, h, "active", c
        for (k, h), c in self.retained.items():
            yield k, h, "retained", c

    def refs(self) -> Counter:
        return Counter(b for *_, c in self.contexts() for b in c.blocks)

    def free(self) -> int:
        return self.n - len(self.refs())

    def held(self, s: MSession) -> int:
        return len({b for k, _, _, c in self.contexts() if k == s.key for b in c.blocks})

    def num_retained(self, s: MSession) -> int:
        return sum(k == s.key for k, _ in self.retained)

    def wants(self, s: MSession) -> bool:
        return bool(s.active) or self.num_retained(s) > 0

    def total_weight(self, asking: MSession) -> int:
        return sum(s.weight for s in self.sessions.values() if self.wants(s)) + \
            (0 if self.wants(asking) else asking.weight)

    def lookup(self, s: MSession, handle: int) -> Ctx | None:
        return s.active.get(handle) or self.retained.get((s.key, handle))

    def blocks_for(self, rows: int) -> int:
        return -(-rows // self.r)

    # ------------------------------------------------------------- blocks
    def written(self, ctx: Ctx | None, start: int, toks: list[int], refs: Counter) -> Ctx:
        """``ctx`` rewound to ``start`` with ``toks`` appended: kept blocks stay, a shared
        partial block that gets rows is copied, new rows take new blocks."""
        old = ctx or Ctx([], [])
        keep = old.blocks[:self.blocks_for(start)]
        if toks and start % self.r and refs[keep[-1]] > 1:
            keep = keep[:-1] + [next(self._ids)]
        end = start + len(toks)
        grown = keep + [next(self._ids) for _ in range(self.blocks_for(end) - len(keep))]
        return Ctx(old.tokens[:start] + list(toks), grown)

    def need(self, ctx: Ctx | None, start: int, toks: list[int]) -> int:
        """Free blocks the write takes: distinct blocks in use after it minus before (>= 0)."""
        if not toks:
            return 0
        refs = self.refs()
        new = self.written(ctx, start, toks, refs)
        rest = refs.copy()
        rest.subtract(ctx.blocks if ctx else [])
        after = {b for b, n in rest.items() if n > 0} | set(new.blocks)
        return max(0, len(after) - len(refs))

    # ------------------------------------------------------- giving back
    def _drop_retained(self, key, gave_back: bool) -> None:
        del self.retained[key]
        if gave_back:
            self.sessions[key[0]].gave_back["retained"] += 1

    def _take_back(self, asking, over, enough, protected) -> None:
        spent = set()
        while not enough():
            ranked = [(o, s) for s in self.sessions.values()
                      if s is not asking and s.active and s.key not in spent and (o := over(s)) > 0]
            if not ranked:
                return
            victim = max(ranked, key=lambda item: item[0])[1]
            handle = next((h for h in reversed(victim.active) if id(victim.active[h]) not in protected), None)
            if handle is None:
                spent.add(victim.key)
                continue
            del victim.active[handle]
            victim.evicted.add(handle)
            victim.gave_back["active"] += 1

    def check_room(self, s: MSession, new: int, protected) -> None:
        if len(s.active) + new > self.max_requests:
            raise Refused("TOO_MANY_REQUESTS")
        num = lambda: sum(len(x.active) for x in self.sessions.values())  # noqa: E731
        if num() + new <= self.max_total:
            return
        w = self.total_weight(s)
        over = lambda x, extra=0: (len(x.active) + extra) * w - self.max_total * x.weight  # noqa: E731
        if over(s, new) <= 0:
            self._take_back(s, over, lambda: num() + new <= self.max_total, protected)
        if num() + new > self.max_total:
            raise Refused("TOO_MANY_REQUESTS")

    def make_room(self, s: MSession, blocks: int, keep, protected) -> None:
        if self.free() >= blocks:
            return
        if blocks > self.n:                     # never fits: refused before anything is dropped
            raise Refused("CAPACITY")
        w = self.total_weight(s)
        over = lambda x, extra=0: (self.held(x) + extra) * w - self.n * x.weight  # noqa: E731
        guard = {id(c) for c in keep} | protected
        for others in (True, False):
            for key in [k for k, c in self.retained.items() if id(c) not in guard and (k[0] != s.key) == others]:
                theirs = over(self.sessions[key[0]])
                if others and not (theirs > 0 and theirs >= over(s, blocks)):
                    continue
                self._drop_retained(key, gave_back=others)
                if self.free() >= blocks:
                    return
        if over(s, blocks) <= 0:
            self._take_back(s, over, lambda: self.free() >= blocks, protected)
        if self.free() < blocks:
            raise Refused("CAPACITY")

    # ---------------------------------------------------------------- ops
    def rows(self, key: str, spans, protected: set | None = None) -> tuple[dict[int, str], list[int]]:
        """An ingest or propose of ``spans`` (handle, start, tokens[, anchor]): per-request failures
        and the indexes admitted (their contexts are written, in order)."""
        s, protected = self.sessions[key], protected if protected is not None else set()
        named = [c for c in (self.lookup(s, h) for h, *_ in spans) if c is not None]
        failures, admitted, fresh, total = {}, [], 0, 0
        for i, (handle, start, toks, *_) in enumerate(spans):
            ctx = self.lookup(s, handle)
            try:
                if ctx is None and handle in s.evicted and start > 0:
                    raise Refused("CAPACITY")
                if start > (len(ctx.tokens) if ctx else 0):
                    raise Refused("CONTEXT_GAP")
                new = ctx is None or s.active.get(handle) is not ctx
                if new:
                    self.check_room(s, fresh + 1, protected)
                need = self.need(ctx, start, toks)
                self.make_room(s, total + need, named, protected)
            except Refused as exc:
                failures[i] = exc.code
                continue
            fresh += new
            total += need
            admitted.append(i)
        for i in admitted:
            handle, start, toks = spans[i][:3]
            ctx = self.lookup(s, handle)
            self.retained.pop((key, handle), None)
            s.evicted.discard(handle)
            if handle not in s.active:
                s.active[handle] = ctx or Ctx([], [])
            written = self.written(ctx, start, toks, self.refs())
            s.active[handle].tokens, s.active[handle].blocks = written.tokens, written.blocks
        return failures, admitted

    def free_handles(self, key: str, handles, retain: bool) -> None:
        s = self.sessions[key]
        for handle in handles:
            s.evicted.discard(handle)
            ctx = s.active.pop(handle, None)
            if ctx is None:
                if not retain:
                    self.retained.pop((key, handle), None)
                continue
            if not retain or self.max_retained <= 0 or not ctx.tokens:
                continue
            self.retained.pop((key, handle), None)
            self.retained[(key, handle)] = ctx
            while len(self.retained) > self.max_retained:
                w = self.total_weight(s)
                over = lambda x: self.num_retained(x) * w - self.max_retained * x.weight  # noqa: E731
                mine = over(s)
                victim = next(k for k in self.retained if (o := over(self.sessions[k[0]])) > 0 and o >= mine)
                self._drop_retained(victim, gave_back=victim[0] != key)

    def clear(self, key: str) -> None:
        s = self.sessions[key]
        s.active.clear()
        s.evicted.clear()
        for k in [k for k in self.retained if k[0] == key]:
            del self.retained[k]

    def close(self, key: str) -> None:
        self.clear(key)
        del self.sessions[key]

    def reconnect(self, key: str, handle: int, toks: list[int]) -> int:
        """Rows restored from a stored context; :class:`Refused` (nothing of it stored) otherwise."""
        s = self.sessions[key]
        best, length = None, 0
        for c in [*s.active.values(), *(c for (k, _), c in self.retained.items() if k == key)]:
            m = min(16, len(c.tokens), len(toks))
            if not m or c.tokens[:m] != toks[:m]:
                continue
            common = next((j for j, (a, b) in enumerate(zip(c.tokens, toks)) if a != b),
                          min(len(c.tokens), len(toks)))
            if common > length:
                best, length = c, common
        if self.needs_hidden and length < len(toks):
            raise Refused("PREFIX_MISMATCH")
        old = self.lookup(s, handle)
        if old is None or s.active.get(handle) is not old:
            self.check_room(s, 1, set())
        need = (1 if best is not None and length % self.r else 0) + \
            self.blocks_for(len(toks)) - self.blocks_for(length)
        self.make_room(s, need, [best] if best is not None else [], set())
        fork = Ctx([], [])
        if best is not None:
            full = best.blocks[:length // self.r]
            fork = Ctx(best.tokens[:length], full + ([next(self._ids)] if length % self.r else []))
        new = self.written(fork, length, toks[length:], self.refs()) if len(toks) > length else fork
        if s.active.get(handle) is old and old is not None:
            del s.active[handle]
        elif old is not None:
            self.retained.pop((key, handle), None)
        s.active[handle] = new
        s.evicted.discard(handle)
        return length
