"""Sessions of ``rollbook proxy``: session keys, logical calls and their attempts, which attempt the
caller consumed, the trajectories each completion becomes, their submission, and rewards.

The policies (docs/online.md has the full text):

- A session is started with a task id, a domain, a group id and size; its key (``rbs-...``) is the
  agent's API key, stored here only as a SHA-256 digest. A key names exactly one session.
- Each call of a session is one turn, numbered from 0 in arrival order. A call is **the same logical
  call** as an earlier one when it carries the same ``Idempotency-Key`` header, or, without one, when
  the ``openai`` client marks it as a retry (``x-stainless-retry-count`` > 0) and its body is
  byte-for-byte equal (after JSON canonicalization) to the latest call of the session with that body.
  An attempt that was not a retry always opens a new turn, even with an identical body.
- Every attempt is recorded: trajectory ``{session_id}/turn-{k}.{choice}/a{attempt}``, request id
  ``turn-{k}.{choice}``. An attempt whose client had gone is submitted with ``consumed`` false; a
  delivered one (written to an open connection) is held by the proxy (``Proxy.release``) until a retry
  of its call shows it was not read (``consumed`` false) or the session moves on (``consumed`` true),
  so the store keeps the attempt the caller read and rejects the others as ``RETRY_ORPHAN``.
- Group: with a non-empty group id, turn ``k`` of the session goes to group ``{group_id}/turn-{k}``
  of expected size ``group_size * n``: turn ``k`` of the group's sessions are compared with each other.
- Rewards (``reward``): ``last`` the delivered choices of the latest turn that was delivered; ``all``
  every delivered turn; a completion id or a turn number: that turn's delivered choices. Rewards go
  through ``SetReward`` by trajectory id, after the trajectory's own submission was answered; they may
  arrive after the session ended.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import queue
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rollbook.client import StoreClient, as_trajectory
from rollbook.rollout.engine import GenerationResult
from rollbook.rollout.proxy.history import Reply, Turn, message_key
from rollbook.v1 import rollbook_pb2 as pb

if TYPE_CHECKING:
    from rollbook.rollout.proxy.render import Message

log = logging.getLogger("rollbook.proxy")

KEY_PREFIX = "rbs-"


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def body_digest(body: Any) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


@dataclass
class Attempt:
    number: int
    created_at: float
    completion_id: str
    trajectory_ids: list[str] = field(default_factory=list)
    delivered: bool | None = None  # None while in flight
    verdicts: list[concurrent.futures.Future] = field(default_factory=list)
    held: list[dict] | None = None  # delivered, not yet submitted: waiting for a sign the caller consumed it
    held_since: float = 0.0
    hold: int | None = None  # its batch in the spool's held/ directory (SubmitQueue.hold), None without a spool
    replies: list[Reply] = field(default_factory=list)  # per choice, once generated: what the next call may continue


@dataclass
class Call:
    turn: int
    body_hash: str
    idempotency_key: str | None
    n: int = 1
    attempts: list[Attempt] = field(default_factory=list)
    turn_plan: Turn | None = None  # its prompt ids and the call it continues (history.py), from its first attempt

    @property
    def delivered(self) -> Attempt | None:
        """The attempt the caller read: the latest delivered one."""
        done = [a for a in self.attempts if a.delivered]
        return done[-1] if done else None


@dataclass
class Session:
    session_id: str
    task_id: str
    domain: str
    group_id: str
    group_size: int
    started_at: float
    ended_at: float | None = None
    expired: bool = False  # ended by the proxy after idle_session_ttl_s without a request
    last_active: float = 0.0  # time.time() of its latest request (completion, reward, end, lookup)
    calls: list[Call] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    # lookups that stay O(1) however long the session: the call of an idempotency key, the latest call
    # of a body sent without one (retries), the calls whose chat history starts with a given message
    _by_key: dict[str, Call] = field(default_factory=dict, repr=False)
    _by_digest: dict[str, Call] = field(default_factory=dict, repr=False)
    _by_first: dict[str, list[Call]] = field(default_factory=dict, repr=False)

    def begin_attempt(self, body: Any, idempotency_key: str | None, retry_count: int, now: float) -> tuple[Call, Attempt]:
        """The call this request belongs to (an existing one for a retry) and its new attempt."""
        digest = body_digest(body)
        with self.lock:
            call = None
            if idempotency_key:
                call = self._by_key.get(idempotency_key)
            elif retry_count > 0:
                call = self._by_digest.get(digest)
            if call is None:
                call = Call(turn=len(self.calls), body_hash=digest, idempotency_key=idempotency_key)
                self.calls.append(call)
                if idempotency_key:
                    self._by_key[idempotency_key] = call
                else:
                    self._by_digest[digest] = call
            number = len(call.attempts)
            prefix = "chatcmpl" if isinstance(body, dict) and "messages" in body else "cmpl"
            attempt = Attempt(number=number, created_at=now, completion_id=f"{prefix}-{self.session_id}-t{call.turn}-a{number}")
            call.attempts.append(attempt)
            return call, attempt

    def plan_turn(self, call: Call, turn: Turn) -> Turn:
        """Record ``turn`` as ``call``'s plan unless its first attempt set one; returns the call's plan."""
        with self.lock:
            if call.turn_plan is None:
                call.turn_plan = turn
                if turn.messages:
                    self._by_first.setdefault(message_key(turn.messages[0]), []).append(call)
            return call.turn_plan

    def calls_starting_with(self, first: Message) -> list[Call]:
        """The chat calls (planned, in turn order) whose rendered messages start with ``first``."""
        with self.lock:
            return list(self._by_first.get(message_key(first), ()))

    def find_turn(self, call: int | str) -> Call | None:
        with self.lock:
            if isinstance(call, int):
                return self.calls[call] if 0 <= call < len(self.calls) else None
            for c in self.calls:
                if any(a.completion_id == call for a in c.attempts):
                    return c
        return None

    def summary(self) -> dict:
        with self.lock:
            return {
                "session_id": self.session_id,
                "task_id": self.task_id,
                "domain": self.domain,
                "group_id": self.group_id,
                "group_size": self.group_size,
                "ended": self.ended_at is not None,
                "expired": self.expired,
                "calls": [
                    {
                        "turn": c.turn,
                        "parent_request_id": c.turn_plan.parent_request_id if c.turn_plan else "",
                        "branched": c.turn_plan.branched if c.turn_plan else False,
                        "attempts": [
                            {
                                "attempt": a.number,
                                "completion_id": a.completion_id,
                                "delivered": a.delivered,
                                "trajectory_ids": a.trajectory_ids,
                            }
                            for a in c.attempts
                        ],
                    }
                    for c in self.calls
                ],
            }


class SessionError(Exception):
    """``status`` and OpenAI error ``code`` for the HTTP answer."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param


class Sessions:
    """Every session this proxy started; ``authenticate`` maps an API key to its session."""

    def __init__(self, *, model_id: str, worker_id: str, max_sessions: int, ended_ttl_s: float, idle_ttl_s: float = 3600.0):
        self.model_id, self.worker_id = model_id, worker_id
        self.max_sessions, self.ended_ttl_s, self.idle_ttl_s = max_sessions, ended_ttl_s, idle_ttl_s
        self._by_id: dict[str, Session] = {}
        self._by_key: dict[bytes, str] = {}
        self._key_of: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def start(self, *, task_id: str, domain: str, group_id: str, group_size: int) -> tuple[Session, str]:
        now = time.time()
        with self._lock:
            self._forget_expired(now)
            if len(self._by_id) >= self.max_sessions:
                raise SessionError(
                    429,
                    "too_many_sessions",
                    f"the proxy holds {self.max_sessions} sessions (max_sessions); end sessions or wait for ended ones to expire",
                )
            session_id = f"s-{secrets.token_hex(8)}"
            key = KEY_PREFIX + secrets.token_urlsafe(24)
            session = Session(session_id, task_id, domain, group_id, group_size, started_at=now, last_active=now)
            self._by_id[session_id] = session
            self._by_key[key_digest(key)] = session_id
            self._key_of[session_id] = key_digest(key)
        return session, key

    def authenticate(self, key: str | None) -> Session | None:
        """The session of ``key``, marked active now."""
        if not key:
            return None
        with self._lock:
            session_id = self._by_key.get(key_digest(key))
            session = self._by_id.get(session_id) if session_id else None
            if session is not None:
                session.last_active = time.time()
            return session

    def get(self, session_id: str) -> Session | None:
        """The session ``session_id``, marked active now."""
        with self._lock:
            session = self._by_id.get(session_id)
            if session is not None:
                session.last_active = time.time()
            return session

    def expire_idle(self, now: float) -> list[Session]:
        """End the sessions without a request for ``idle_ttl_s`` and nothing in flight (marked
        ``expired``: no more completions or rewards); returns them. They are forgotten
        ``ended_ttl_s`` later, like ended ones."""
        with self._lock:
            idle = [
                s
                for s in self._by_id.values()
                if s.ended_at is None
                and now - s.last_active > self.idle_ttl_s
                and not any(a.delivered is None for c in s.calls for a in c.attempts)
            ]
            for s in idle:
                s.ended_at, s.expired = now, True
            self._forget_expired(now)
        return idle

    def _forget_expired(self, now: float) -> None:
        old = [s for s in self._by_id.values() if s.ended_at is not None and now - s.ended_at > self.ended_ttl_s]
        for s in old:
            del self._by_id[s.session_id]
            self._by_key.pop(self._key_of.pop(s.session_id), None)

    def trajectories(
        self,
        session: Session,
        call: Call,
        attempt: Attempt,
        results: Sequence[GenerationResult],
        delivered: bool,
        *,
        record: bool = True,
    ) -> list[dict]:
        """The trajectories of one finished attempt (one per choice), recorded on the attempt unless
        ``record`` is false."""
        out: list[dict[str, Any]] = []
        for choice, r in enumerate(results):
            request_id = f"turn-{call.turn}.{choice}"
            out.append(
                {
                    "trajectory_id": f"{session.session_id}/{request_id}/a{attempt.number}",
                    "session_id": session.session_id,
                    "group_id": f"{session.group_id}/turn-{call.turn}" if session.group_id else "",
                    "group_size": session.group_size * len(results) if session.group_id else 0,
                    "request_id": request_id,
                    "parent_request_id": call.turn_plan.parent_request_id if call.turn_plan else "",
                    "branched": call.turn_plan.branched if call.turn_plan else False,
                    "attempt": attempt.number,
                    "consumed": delivered,
                    "task_id": session.task_id,
                    "domain": session.domain,
                    "model_id": self.model_id,
                    "prompt_token_ids": list(r.prompt_token_ids),
                    "output_token_ids": list(r.output_token_ids),
                    "output_logprobs": list(r.output_logprobs),
                    "output_versions": list(r.output_versions),
                    "temperature": r.temperature,
                    "top_p": r.top_p,
                    "top_k": r.top_k,
                    "finish_reason": r.finish_reason,
                    "worker_id": self.worker_id,
                    "created_at": attempt.created_at,
                }
            )
        if not record:
            return out
        with session.lock:
            call.n = len(results)
            attempt.trajectory_ids = [str(t["trajectory_id"]) for t in out]
            attempt.delivered = delivered
        return out


def reward_targets(session: Session, which: str | int) -> list[tuple[Call, Attempt]]:
    """The delivered attempts a reward goes to (module docstring); raises ``SessionError``."""
    with session.lock:
        delivered = [(c, c.delivered) for c in session.calls if c.delivered is not None]
    if which == "all":
        targets = delivered
    elif which == "last":
        targets = delivered[-1:]
    else:
        call = session.find_turn(which)
        if call is None:
            raise SessionError(404, "unknown_call", f"session {session.session_id} has no call {which!r}", "call")
        attempt = call.delivered
        targets = [(call, attempt)] if attempt is not None else []
    if not targets:
        raise SessionError(
            409,
            "nothing_delivered",
            f"session {session.session_id} has no delivered completion for call={which!r}: nothing to reward",
            "call",
        )
    return [(c, a) for c, a in targets if a is not None]


class SubmitQueue:
    """Submits trajectories in batches from one thread; each trajectory's future gets its verdict.

    With ``spool_dir`` it is durable (rollout/spool.py, two ``Spool`` directories under it):

    - ``hold(trajectories)`` writes a finished completion to ``held/`` (fsync'd) before the proxy
      sends any of it, as consumed; ``put(final, unhold=seq)`` writes the final trajectories (consumed
      or not, once that is known) to ``submit/``, and only then drops the ``held/`` copy;
    - a batch leaves ``submit/`` once the store answered every trajectory of it;
    - on start, every ``held/`` batch left by a killed proxy moves to ``submit/`` as it is (delivered
      counts as consumed, as at a clean shutdown), and ``submit/`` is replayed in order before new
      work. Trajectory ids are the store's idempotency key: a batch sent twice (killed after the store
      committed it, or between the ``submit/`` write and the ``held/`` removal) comes back
      ``DUPLICATE``, so each completion is stored once.
    """

    def __init__(
        self,
        client: StoreClient,
        *,
        batch_size: int = 64,
        linger_s: float = 0.2,
        spool_dir: str | None = None,
        spool_max_bytes: int = 256 << 20,
    ):
        self.client, self.batch_size, self.linger_s = client, batch_size, linger_s
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._hurry = threading.Event()  # send the batch being gathered now (SubmitQueue.hurry)
        self._lock = threading.Lock()
        self.submitted = self.failed = self.recovered = 0
        self.pending = 0  # put and not yet answered
        self.spool = self.held_spool = None
        self._left: dict[int, int] = {}  # submit/ batch -> its trajectories not yet answered
        if spool_dir is not None:
            import pathlib

            from rollbook.rollout.spool import Spool

            root = pathlib.Path(spool_dir)
            self.spool = Spool(root / "submit", max_bytes=spool_max_bytes)
            self.held_spool = Spool(root / "held", max_bytes=spool_max_bytes)
            self._recover()
        self._thread = threading.Thread(target=self._run, name="proxy-submit", daemon=True)
        self._thread.start()

    def _recover(self) -> None:
        """Submit what a killed proxy left, before this one serves: ``held/`` moved to ``submit/``
        as it is, then every ``submit/`` batch in order (``StoreClient.submit`` resends while the
        store is briefly down; a store that stays away fails the start, and the spool stays)."""
        assert self.spool is not None and self.held_spool is not None
        while (item := self.held_spool.peek()) is not None:
            seq, request = item
            self.spool.put(list(request.trajectories))
            self.held_spool.remove(seq)
        while (item := self.spool.peek()) is not None:
            seq, request = item
            result = self.client.submit(list(request.trajectories))
            self.spool.remove(seq)
            self.recovered += len(request.trajectories)
            log.warning(
                "replayed %d trajectories a previous proxy left in its spool: %d accepted, %d already stored, %d rejected",
                len(request.trajectories),
                result.accepted,
                result.duplicates,
                result.rejected,
            )

    def hold(self, trajectories: list[dict]) -> int | None:
        """Write a finished completion durably before it is sent (``held/``); None without a spool."""
        if self.held_spool is None or not trajectories:
            return None
        return self.held_spool.put([as_trajectory(t) for t in trajectories])

    def put(self, trajectories: list[dict], *, unhold: int | None = None) -> list[concurrent.futures.Future]:
        seq = None
        if self.spool is not None and trajectories:
            seq = self.spool.put([as_trajectory(t) for t in trajectories])
            with self._lock:
                self._left[seq] = len(trajectories)
        if unhold is not None and self.held_spool is not None:
            self.held_spool.remove(unhold)  # after the final copy is durable in submit/
        futures = []
        for t in trajectories:
            future: concurrent.futures.Future = concurrent.futures.Future()
            future.add_done_callback(self._done)
            with self._lock:
                self.pending += 1
            self._queue.put((t, future, seq))
            futures.append(future)
        if self._queue.qsize() >= self.batch_size:  # a full batch waits for no linger
            self._hurry.set()
        return futures

    def _done(self, _future) -> None:
        with self._lock:
            self.pending -= 1

    def _answered(self, seq: int | None) -> None:
        if seq is None or self.spool is None:
            return
        with self._lock:
            self._left[seq] -= 1
            last = self._left[seq] == 0
            if last:
                del self._left[seq]
        if last:
            self.spool.remove(seq)

    def hurry(self) -> None:
        """Someone waits for the queued trajectories' verdicts (a reward, a session's end): the batch
        being gathered goes now instead of at the end of its linger."""
        self._hurry.set()

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            try:
                first = self._queue.get(timeout=0.1)
            except queue.Empty:
                continue
            batch = [first]
            deadline = time.monotonic() + self.linger_s
            # wait out the linger, woken only by a hurry, a full batch or the close (put sets the
            # event), not once per completion; then take what came
            while not (self._hurry.is_set() or self._stop.is_set()) and (left := deadline - time.monotonic()) > 0:
                self._hurry.wait(left)
            self._hurry.clear()
            while len(batch) < self.batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                result = self.client.submit([t for t, _, _ in batch])
            except Exception as exc:  # the store stayed unreachable past the client's retry deadline
                log.error(
                    "submitting %d trajectories failed: %s%s",
                    len(batch),
                    exc,
                    " (kept in the spool for the next start)" if self.spool is not None else "",
                )
                self.failed += len(batch)
                for _, future, _ in batch:
                    future.set_exception(exc)
                continue
            self.submitted += len(batch)
            for t, future, seq in batch:
                verdict = result.verdicts.get(t["trajectory_id"])
                if verdict is not None and verdict.status == pb.Verdict.REJECTED:
                    log.warning("trajectory %s rejected: %s %s", t["trajectory_id"], verdict.reason, verdict.detail)
                future.set_result(verdict)
                self._answered(seq)

    def close(self, timeout: float = 60.0) -> None:
        self._stop.set()
        self._hurry.set()
        self._thread.join(timeout)
        for spool in (self.spool, self.held_spool):
            if spool is not None:
                spool.close()
