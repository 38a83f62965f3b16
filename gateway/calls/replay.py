"""Replay (docs/architecture.md, rule 10): an attempt that resumes after an infrastructure
failure is handed the calls an earlier attempt recorded, the way Temporal hands a workflow its
history. Each request the new agent sends whose canonical form equals a recorded call's is
answered from that record (see `replayer`); the first that equals none goes to the policy.

The canonical form is the chat (or text completion) request the gateway forwards, whatever
protocol the agent spoke, less what never changes an answer (the model name DARL forces,
whether it streams), with key order and JSON spacing gone. A recorded call is used at most
once, and concurrent requests each take the first unused call of their own form, so agents
that issue calls in parallel replay too. Once a live answer has reached the agent, it has seen
what the recorded run never did: nothing more is replayed.

The record offered is the lineage the workflow names (`ReplayClaim.sources`, every attempt
lost before, newest first): the calls of the last, and, when that attempt was lost before its
own replay was over (it has no live call: an attempt that recorded nothing among them), the
calls it had yet to reproduce of the attempt before, and so on. An attempt's record includes
the answers its agent never received (it was lost while they were at the policy server,
`CallRecord.unreceived`): offered after the received calls of their form, they count as no
live call, and one left unused is no divergence.

Whether a recorded call is taken, and whether the replay is over, the store decides, when the
replayed call is appended (`store.codec.check_append`: under the attempt's lock, or at the
sequence its conditional PUT takes): a recorded call another call of the attempt reproduces
already, or any once the attempt holds a live call, is refused, whichever replica serves it.
A `ReplaySession` is one process's cache of that, rebuilt from the store on its first use (this
attempt's records say which offered calls are used and whether a live call was answered):
what it offers, the store may refuse (another replica served that record, or a live call),
and the replayer then takes the next record or goes live; a call it counted as used (an
append whose outcome is unknown among them) it never offers again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from darl.gateway.errors import InvalidReplayError
from darl.gateway.lru import LRUCache
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.workflows.contracts import ReplayOutcome
from darl.workflows.replay_normalizers import Normalizer
from darl.workflows.rollout_token import PrefixClaim, ReplayClaim, TokenClaims

log = logging.getLogger(__name__)

# Request fields that never change what the policy answers: the model DARL names itself, and
# whether the answer is streamed (a recorded answer is served either way).
NOT_COMPARED = frozenset({"model", "stream", "stream_options"})


def _normalized_content(content: Any, normalizer: Normalizer) -> Any:
    if isinstance(content, str):
        return normalizer.apply(content)
    if isinstance(content, list):
        return [
            {**part, "text": normalizer.apply(part["text"])}
            if isinstance(part, dict) and isinstance(part.get("text"), str)
            else part
            for part in content
        ]
    return content


def canonical_form(
    protocol: str, endpoint: str, forwarded: dict[str, Any], normalizer: Normalizer | None = None
) -> str:
    """The digest two requests share exactly when a recorded answer to one answers the other:
    protocol, endpoint, messages or prompt, tools, tool choice and every sampling field, with
    the normalizer's spans blanked in message text."""
    body = {k: v for k, v in forwarded.items() if k not in NOT_COMPARED}
    if normalizer:
        if isinstance(body.get("messages"), list):
            body["messages"] = [
                {**m, "content": _normalized_content(m.get("content"), normalizer)}
                if isinstance(m, dict)
                else m
                for m in body["messages"]
            ]
        if isinstance(body.get("prompt"), str):
            body["prompt"] = normalizer.apply(body["prompt"])
    text = json.dumps(
        [protocol, endpoint, body], sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Recorded:
    """A recorded call offered to the replay: the record (its request reduced to the model
    that answered), its canonical form under the rollout's normalizer (what a request is
    matched by), and without it (a request equal to it exactly goes first)."""

    record: CallRecord
    normalized_form: str
    exact_form: str


@dataclass(frozen=True)
class Match:
    recorded: Recorded
    # The request equals the record only with the normalizer's spans blanked.
    normalized: bool


def check_lineage(sources: Sequence[int], attempt: int, prefix: PrefixClaim | None = None) -> None:
    """Raise a 400 unless `sources` are distinct earlier attempts, newest first (none only for
    a rollout that starts from a prefix)."""
    if not sources and prefix is not None:
        return
    if (
        not sources
        or list(sources) != sorted(set(sources), reverse=True)
        or sources[-1] < 1
        or sources[0] >= attempt
    ):
        raise InvalidReplayError(f"attempt {attempt} cannot replay attempts {list(sources)}")


async def offered_calls(
    store: TrajectoryStore,
    rollout_id: str,
    sources: Sequence[int],
    prefix: PrefixClaim | None = None,
) -> list[CallRecord]:
    """The recorded calls an attempt that replays `sources` (newest first) is offered, in
    order: the newest source's; then, while the source read last has no live call (it was
    lost before its replay was over), the calls of the one before that it had yet to
    reproduce, and after the oldest, the `prefix`'s the rollout starts from. A call
    reproduced by a newer record is offered as that record only."""
    offered: list[CallRecord] = []
    reproduced: set[str] = set()
    for attempt in sources:
        records = await store.read(rollout_id, attempt)
        # An unreceived answer its own attempt reproduced (a retried request) is offered once,
        # as that reproduction.
        reproduced |= {r.replayed_from for r in records if r.replayed_from is not None}
        offered += [r for r in records if r.call_id not in reproduced]
        if received_live(records):
            return offered
    if prefix is not None:
        records = await prefix_records(store, prefix)
        offered += [r for r in records if r.call_id not in reproduced]
    return offered


async def prefix_records(store: TrajectoryStore, prefix: PrefixClaim) -> list[CallRecord]:
    """The prefix's calls: the first `calls` the attempt committed, in order (fewer when it
    holds fewer: its agent then reaches the policy sooner)."""
    records = await store.read(prefix.rollout_id, prefix.attempt)
    return [r for r in records if not r.unreceived][: prefix.calls]


def received_live(records: Sequence[CallRecord]) -> list[CallRecord]:
    """An attempt's live calls whose answer may have reached its agent (after one, nothing is
    replayed): its own calls, received, or its own unreceived answers received by a retry of
    their request (`idempotency`)."""
    own_unreceived = {r.call_id for r in records if r.unreceived}
    return [
        r
        for r in records
        if not r.unreceived and (r.replayed_from is None or r.replayed_from in own_unreceived)
    ]


class ReplaySession:
    """The record one attempt replays, and what it has used of it, as far as this process
    knows (the store decides: see the module's docstring)."""

    def __init__(
        self,
        claim: ReplayClaim,
        offered: list[CallRecord],
        attempt_calls: list[CallRecord],
    ) -> None:
        """`offered`: the recorded calls of the lineage (`offered_calls`); `attempt_calls`:
        the calls this attempt has recorded so far (which of those it reproduces)."""
        self.normalizer = Normalizer(claim.normalize, claim.patterns)
        used = {r.replayed_from for r in attempt_calls if r.replayed_from is not None}
        self._unused: dict[str, deque[Recorded]] = {}
        # An answer no agent received goes after the received calls of its form: an agent
        # that asked again and got an answer continued from that one.
        ordered = [r for r in offered if not r.unreceived] + [r for r in offered if r.unreceived]
        for record in ordered:
            if record.call_id in used:
                continue
            exact, normalized = self._forms(record.protocol, record.endpoint, record.request)
            slim = replace(record, request={"model": record.request.get("model")})
            self._unused.setdefault(normalized, deque()).append(Recorded(slim, normalized, exact))
        self.left = sum(len(q) for q in self._unused.values())
        # A live answer reached the agent: it is past what the record can answer.
        self.live = bool(received_live(attempt_calls))
        self.diverged = False

    def _forms(self, protocol: str, endpoint: str, forwarded: dict[str, Any]) -> tuple[str, str]:
        """A request's canonical form exactly, and under the normalizer."""
        exact = canonical_form(protocol, endpoint, forwarded)
        if not self.normalizer:
            return exact, exact
        return exact, canonical_form(protocol, endpoint, forwarded, self.normalizer)

    def take(self, protocol: str, endpoint: str, forwarded: dict[str, Any]) -> Match | None:
        """The first unused recorded call this request equals, now taken; None when the
        replay is over or nothing recorded equals it (the call goes live)."""
        if self.live or not self.left:
            return None
        exact, normalized = self._forms(protocol, endpoint, forwarded)
        queue = self._unused.get(normalized)
        if not queue:
            self.diverged = True
            return None
        # Under a normalizer, a recorded call equal to the request exactly goes first.
        chosen = next((r for r in queue if r.exact_form == exact), queue[0])
        queue.remove(chosen)
        self.left -= 1
        return Match(chosen, normalized=chosen.exact_form != exact)

    def served_elsewhere(self, call_ids: frozenset[str]) -> None:
        """The store says these recorded calls are served (through another replica, or before
        this session was built): none is offered again."""
        for form, queue in list(self._unused.items()):
            kept = deque(r for r in queue if r.record.call_id not in call_ids)
            self.left -= len(queue) - len(kept)
            if kept:
                self._unused[form] = kept
            else:
                del self._unused[form]

    def give_back(self, match: Match) -> None:
        """A taken call that could not be recorded: the agent may ask again."""
        self._unused.setdefault(match.recorded.normalized_form, deque()).appendleft(match.recorded)
        self.left += 1

    def end_replay(self) -> None:
        """A live answer reached the agent: nothing more is replayed."""
        self.live = True


# How many attempts' replay sessions a gateway holds (least recently used evicted).
REPLAY_SESSIONS = 1024


class ReplayBook:
    """The replay sessions of the attempts this gateway serves, rebuilt from the store when
    not held (a restart, an eviction, another replica's attempt); at most `bound` held."""

    def __init__(self, store: TrajectoryStore, bound: int = REPLAY_SESSIONS) -> None:
        self._store = store
        self._sessions: LRUCache[tuple[str, int], ReplaySession] = LRUCache(bound)
        self._loading: dict[tuple[str, int], asyncio.Lock] = {}

    async def session(self, claims: TokenClaims) -> ReplaySession:
        claim = claims.replay
        if claim is None:
            raise InvalidReplayError("the attempt does not replay")
        check_lineage(claim.sources, claims.attempt, claim.prefix)
        key = (claims.rollout_id, claims.attempt)
        held = self._sessions.get(key)
        if held is not None:
            return held
        lock = self._loading.setdefault(key, asyncio.Lock())
        async with lock:
            held = self._sessions.peek(key)
            if held is None:
                offered = await offered_calls(
                    self._store, claims.rollout_id, claim.sources, claim.prefix
                )
                attempt_calls = await self._store.read(claims.rollout_id, claims.attempt)
                held = ReplaySession(claim, offered, attempt_calls)
                self._sessions.put(key, held)
                log.info(
                    "%s attempt %d replays %d call(s) of attempt(s) %s%s",
                    claims.rollout_id,
                    claims.attempt,
                    held.left,
                    list(claim.sources),
                    ""
                    if claim.prefix is None
                    else f" and {claim.prefix.rollout_id} attempt {claim.prefix.attempt}",
                )
        self._loading.pop(key, None)
        return held

    def end_replay(self, rollout_id: str, attempt: int) -> None:
        """A live call of the attempt is recorded and about to be answered: its replay is
        over."""
        held = self._sessions.peek((rollout_id, attempt))
        if held is not None:
            held.end_replay()

    def forget(self, rollout_id: str, attempt: int) -> None:
        self._sessions.pop((rollout_id, attempt), None)


async def replay_outcome(
    store: TrajectoryStore,
    rollout_id: str,
    sources: Sequence[int],
    records: list[CallRecord],
    prefix: PrefixClaim | None = None,
) -> ReplayOutcome:
    """What an attempt whose calls are `records` made of the record of `sources` (and of the
    `prefix` its rollout starts from), read from the store (so whichever replica closes the
    attempt can say it)."""
    source = await offered_calls(store, rollout_id, sources, prefix)
    used = {r.replayed_from for r in records if r.replayed_from is not None}
    live_calls = received_live(records)
    live_ids = {r.call_id for r in live_calls}
    replayed = [r for r in records if r.replayed_from is not None and r.call_id not in live_ids]
    diverged_at = None
    if any(r.call_id not in used for r in source if not r.unreceived):
        live = [r.sequence for r in live_calls]
        diverged_at = min(live) if live else len(records)
    return ReplayOutcome(
        sources=list(sources),
        recorded=len(source),
        replayed=len(replayed),
        normalized=sum(1 for r in replayed if r.replay_normalized),
        diverged_at=diverged_at,
        prefix_calls=0
        if prefix is None
        else await _prefix_calls(store, rollout_id, sources, records, prefix),
    )


async def _prefix_calls(
    store: TrajectoryStore,
    rollout_id: str,
    sources: Sequence[int],
    records: list[CallRecord],
    prefix: PrefixClaim,
) -> int:
    """How many of `records`' first calls, in order, reproduce a prefix call: one it
    replayed, or one an earlier attempt of the lineage (oldest first) reproduced."""
    reproducing = {r.call_id for r in await prefix_records(store, prefix)}
    for attempt in reversed(sources):
        for record in await store.read(rollout_id, attempt):
            if record.replayed_from in reproducing:
                reproducing.add(record.call_id)
    count = 0
    for record in records:
        if record.replayed_from not in reproducing:
            break
        count += 1
    return count
