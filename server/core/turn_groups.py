"""The server process's own frontends submit the alike requests of one event-loop turn as groups.

Why: in `kiln serve` without frontend processes, one event-loop thread parses, checks, queues, batches, runs and
answers every request, and the core's share of that (checks, queueing, batch forming, statistics, outputs) costs
about as much per request as HTTP and JSON do. Under load several requests arrive per turn of the loop (uvloop
reads every ready connection in one turn); the alike ones (`grouping.group_key`: same model, input names,
datatypes and shapes past the batch dim, requested outputs, no per-request options) go through the core once, as
the groups a frontend process sends over its socket (grouping.py), cut to the model's max_batch_size rows. Each
request still gets its own response, id, rows and statistics; a group the core would not run as one job (no
dynamic batcher, tracing on, a response cache) is not made: its requests go one by one, as before.

A group that the core refuses as invalid is submitted again member by member, so each client gets the message its
own request earns (the shapes in a group's message would be the group's).
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

from .errors import ErrorKind, ServerError
from .grouping import Answer, by_reference, concatenate, group_key, member_answers, rows
from .types import InferRequest


def _answered(value: Any, error: BaseException | None) -> None:
    """What an answered member's reply becomes: its caller's callback (which holds the caller, which holds the
    member) is dropped, so the request's objects go with reference counting, not with a garbage collection."""


class _Member:
    """One request of a turn's group, and what its caller cancels to withdraw it (`done()` / `cancel()`, as the
    future `ServerCore.submit_infer` returns)."""

    __slots__ = ("request", "reply", "answered", "job", "group")

    def __init__(self, request: InferRequest, reply: Answer) -> None:
        self.request = request
        self.reply = reply
        self.answered = False
        self.job: Any = None  # the core's job, once submitted on its own
        self.group: _Group | None = None  # the group it went with

    def answer(self, value: Any, error: BaseException | None) -> None:
        if not self.answered:
            self.answered = True
            reply, self.reply, self.group = self.reply, _answered, None  # no cycles left for the collector
            reply(value, error)

    def done(self) -> bool:
        return self.answered

    def cancel(self) -> bool:
        """The caller gave up: it hears CancelledError now (as from a cancelled job); the core's work stops once
        no member of its group waits any more."""
        if self.answered:
            return False
        group = self.group
        self.answer(None, asyncio.CancelledError())
        if self.job is not None:
            self.job.cancel()
        elif group is not None:
            group.withdrawn()
        return True


class _Group:
    """Members submitted as one request: the core's jobs for it, and the members' answers from its reply."""

    __slots__ = ("owner", "members", "sizes", "jobs", "waiting")

    def __init__(self, owner: TurnGroups, members: list[_Member], sizes: list[int]) -> None:
        self.owner = owner
        self.members = members
        self.sizes = sizes
        self.jobs: list[asyncio.Future] = []
        self.waiting = len(members)
        for member in members:
            member.group = self

    def withdrawn(self) -> None:
        self.waiting -= 1
        if not self.waiting:
            for job in self.jobs:
                job.cancel()

    def replied(self, value: Any, error: BaseException | None) -> None:
        members = self.members
        if isinstance(error, ServerError) and error.kind == ErrorKind.INVALID_ARGUMENT:
            for member in members:  # each request's own words (its shapes, not the group's)
                member.group = None
                self.owner.submit_alone(member)
            return
        if error is not None:
            for member in members:
                member.answer(None, error)
            return
        try:
            answers = member_answers(value, [m.request.id for m in members], self.sizes)
        except ValueError as e:
            answers = [(None, ServerError(ErrorKind.INTERNAL, str(e)))] * len(members)
        for member, (response, failure) in zip(members, answers):
            member.answer(response, failure)


class TurnGroups:
    """`ServerCore.submit_infer` for the server process's HTTP and gRPC inference roads, grouping per loop turn;
    every other attribute is the core's."""

    def __init__(self, core: Any) -> None:
        self._core = core
        self._groups: dict[Hashable, list[_Member]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._core, name)

    def submit_infer(self, request: InferRequest, reply: Answer) -> Any:
        """As `ServerCore.submit_infer`: `reply` is called once, on the event loop; returns what to cancel."""
        key = group_key(request)
        if key is None or by_reference(key):  # tensors in shared memory: the core reads them where they are
            return self._core.submit_infer(request, reply)
        member = _Member(request, reply)
        members = self._groups.get(key)
        if members is None:
            members = self._groups[key] = []
            if len(self._groups) == 1:
                if self._loop is None:
                    self._loop = asyncio.get_running_loop()
                self._loop.call_soon(self._submit_groups)
        members.append(member)
        return member

    def submit_alone(self, member: _Member) -> None:
        if not member.answered:
            member.job = self._core.submit_infer(member.request, member.answer)

    def _submit_groups(self) -> None:
        """This turn's groups to the core, each cut into runs of at most the model's max_batch_size rows."""
        groups, self._groups = self._groups, {}
        for members in groups.values():
            members = [m for m in members if not m.answered]  # callers that gave up meanwhile
            if not members:
                continue
            limit = self._core.group_rows(members[0].request) if len(members) > 1 else 0
            run: list[_Member] = []
            total = 0
            for member in members:
                size = rows(member.request)
                if run and total + size > limit:
                    self._submit_run(run)
                    run, total = [], 0
                run.append(member)
                total += size
            if run:
                self._submit_run(run)

    def _submit_run(self, run: list[_Member]) -> None:
        if len(run) == 1:
            self.submit_alone(run[0])
            return
        requests = [m.request for m in run]
        group = _Group(self, run, [rows(r) for r in requests])
        group.jobs = self._core.submit_infer_group(concatenate(requests), group.sizes, group.replied)
