"""Fair shares: how much of each of the server's tables a session is guaranteed.

The server has three tables that sessions share: the engine's block pool,
the active requests (``--max-requests-total``) and the retained contexts
(``--max-retained-requests``). Each is divided among the sessions that want
it right now — those holding an active request or a retained context, plus
the one asking — in proportion to their weights (``--session-weight``,
default 1): a session's share of a table of ``size`` entries is
``size * weight / total weight``. A session may borrow beyond its share
whatever the others leave unused; when one within its share needs room, the
sessions over theirs give it back (:mod:`k3_accel.server.state` does the
evicting, in the order this module ranks). A session is never made to give
back to one that is further over its share than itself.

All arithmetic is in integers, scaled by the total weight: ``over`` is
``used * W - size * weight``, positive exactly when a session is over its
share, and comparable between sessions of one division.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Protocol

MAX_WEIGHT = 1000
_WEIGHT = re.compile(r"(?P<name>\S+)=(?P<weight>\d+)")      # the last "=": Z85 keys may hold "="


class Contender(Protocol):
    weight: int

    def wants_room(self) -> bool: ...


@dataclass(frozen=True)
class Division:
    """One table of ``size`` entries divided among sessions whose weights add up to ``total``."""
    size: int
    total: int

    def guaranteed(self, weight: int) -> int:
        """Entries a session of ``weight`` can always hold."""
        return self.size * weight // self.total

    def over(self, used: int, weight: int) -> int:
        """How far ``used`` entries are over the share of ``weight`` (scaled; > 0: over it)."""
        return used * self.total - self.size * weight


def wanting_weight(sessions: Iterable[Contender]) -> int:
    """The weights of the sessions that want room now, added up."""
    return sum(s.weight for s in sessions if s.wants_room())


def divide(size: int, sessions: Iterable[Contender], asking: Contender, wanting: int | None = None) -> Division:
    """``size`` divided among the sessions that want room now (``wanting``: their weights, added
    up, when already known) and ``asking``."""
    wanting = wanting_weight(sessions) if wanting is None else wanting
    return Division(size, wanting + (0 if asking.wants_room() else asking.weight))


def gives_way(mine: int, theirs: int) -> bool:
    """Whether a session ``theirs`` over its share gives room to one ``mine`` over its own (both
    from one :class:`Division`): it must be over its share, and at least as far over as the other."""
    return theirs > 0 and theirs >= mine


def parse_weight(text: str) -> tuple[str, int]:
    """``NAME=W`` (``--session-weight``): a hello client label or a CURVE client public key, and a
    weight 1..MAX_WEIGHT; ValueError naming the problem otherwise."""
    m = _WEIGHT.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r}: expected NAME=WEIGHT (NAME: a client label or CURVE public key)")
    weight = int(m["weight"])
    if not 1 <= weight <= MAX_WEIGHT:
        raise ValueError(f"{text!r}: the weight must be 1..{MAX_WEIGHT}")
    return m["name"], weight
