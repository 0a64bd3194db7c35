"""Whose call a question naming no request is: the one call on a shared session, and the pool's memory of tools
seen asking (given a session of their own from then on). Imports the session protocol only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Final

import structlog

from proxy.upstream.session import Notifications, Session, Sink
from proxy.wire.translate import INPUT_METHODS
from proxy.wire.upstream_events import UpstreamEvent, UpstreamServerRequest

log = structlog.get_logger(__name__)

# Callers remembered as askers, least recently seen first out. The names come from calls that reached the
# upstream and were asked something there, so this holds the server's asking tools unless resource URIs vary.
MAX_REMEMBERED_ASKERS: Final = 1024


class QuestionOwners:
    """What the pool knows about questions sent naming no request.

        - `asked_before(asker)`: a call of `asker` (e.g. "tools/call sample") was asked something before. Such a
          call gets a session of its own even when its client declared nothing it could be asked, so its question
          is attributed to it and its client told what it lacks (-32021) every time. Which kinds it asked is kept
          for the log; for the decision any kind will do: a client that declared one at all is given a session of
          its own anyway, so a call on the shared session lacks every kind seen.
        - `learning(asker, sink)`: the sink of a call, wrapped so that a question reaching it is remembered.
        - `sharing(session, sink)`: while the call runs on a shared session; while it is the only such call there,
          a question naming no request is its own (only questions: notifications are nobody's in particular).
          With two or more, nobody can tell, and the session refuses it as before.

    A legacy server may ask the client something without naming the request it serves: an mcp 1.x server does so for
    a plain `ctx.session.create_message(...)` (over HTTP on the session's GET stream; over stdio nothing names a
    request at all). A call leased a session of its own gets all of it. On a shared session the question is
    attributed while exactly one call runs there, and a tool (prompt, resource) once seen asking is given a session
    of its own from then on. Imports the session protocol only; the pool uses it, the sessions do not."""

    def __init__(self) -> None:
        self._asked: OrderedDict[str, frozenset[str]] = OrderedDict()
        self._sharers: dict[Session, list[Sink]] = {}

    def asked_before(self, asker: str | None) -> bool:
        return asker is not None and asker in self._asked

    def remember(self, asker: str, method: str) -> None:
        before = self._asked.pop(asker, frozenset())
        self._asked[asker] = before | {method}
        if method not in before:
            log.info("upstream_asker_remembered", asker=asker, input_methods=sorted(self._asked[asker]))
        while len(self._asked) > MAX_REMEMBERED_ASKERS:
            self._asked.popitem(last=False)

    def learning(self, asker: str | None, sink: Sink) -> Sink:
        if asker is None:
            return sink

        async def learn(event: UpstreamEvent) -> None:
            if isinstance(event, UpstreamServerRequest) and event.method in INPUT_METHODS:
                self.remember(asker, event.method)
            await sink(event)

        return learn

    @contextmanager
    def sharing(self, session: Session, sink: Sink, notifications: Notifications) -> Iterator[None]:
        async def questions_only(event: UpstreamEvent) -> None:
            if isinstance(event, UpstreamServerRequest):
                await sink(event)

        sharers = self._sharers.setdefault(session, [])
        sharers.append(questions_only)
        self._own(session, notifications)
        try:
            yield
        finally:
            sharers.remove(questions_only)
            if not sharers:
                del self._sharers[session]
            self._own(session, notifications)

    def _own(self, session: Session, notifications: Notifications) -> None:
        """The shared session is lent to its one call, or to nobody (its questions are refused); its
        notifications keep going to the principal's listen streams either way."""
        sharers = self._sharers.get(session, [])
        if len(sharers) == 1:
            session.lending.lend(sharers[0], notifications)
        else:
            session.lending.take_back()
