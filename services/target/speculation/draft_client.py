"""The target's side of the draft service: one long-lived ProposeStream, used from the
engine thread with a per-step deadline.

Every failure is a fallback, never an error: when the draft service is down, slow past
the deadline, answers with invalid trees or refuses one sequence (no tree for it), the
affected sequences decode normally for that step. A sequence whose draft state may be out of step with ours (a failed or late
step, a reconnect) is released on the draft side and re-sent with its full history.

This client alone knows what the draft holds of each sequence (`synced_tokens`): the
speculator hands it a sequence's whole committed history every step, and it sends the
tokens the draft has not seen (all of them, with the trace context, on a first call or a
resync).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

import grpc

from services.common import feature_rows
from services.common.draft_tree import DraftTree
from specmesh.proto.v1 import draft_service_pb2, draft_service_pb2_grpc
from services.common.tls import MeshTls, internal_sync_channel

log = logging.getLogger(__name__)
MAX_UNRELEASED = 65536  # release ids kept for retry; beyond, the draft's idle TTL frees them
RELEASE_RETRY_MIN_S, RELEASE_RETRY_MAX_S = 0.25, 2.0  # backoff of a failed Release's own retry timer


@dataclass(frozen=True)
class DraftRequest:
    seq_id: str
    token_ids: list[int]  # the sequence's committed tokens, all of them (the client sends what is new)
    method: int  # common_pb2.SpeculationMethod
    max_depth: int
    max_nodes: int
    tenant_salt: str
    span_context: object = None  # the request's span: its trace context goes with a full history
    sampling: object = None  # the request's SamplingConfig: a sampling draft drafts as it samples
    draft_seed: int | None = None  # seeds the draft's own sampler (`draft_seed`); None = random
    features: tuple[int, object] | None = None  # EAGLE: (start, rows [m, hidden]) of new committed positions


# What the draft holds of a sequence, in `DraftClient._synced`: absent = nothing (never sent,
# or released); a count = exactly its first that many committed tokens, on this stream;
# OUT_OF_STEP = it may hold a partial history (a failed or late step, a lost stream): it is
# released before the full history is sent again.
OUT_OF_STEP = None


class DraftClient:
    def __init__(self, address: str, timeout_s: float, vocab_size: int,
                 reconnect_interval_s: float = 1.0, tls: MeshTls | None = None) -> None:
        self.address = address
        self.tls = tls  # mutual TLS to the draft service; None = plaintext (dev mode)
        self.timeout_s = timeout_s
        self.vocab_size = vocab_size
        self.reconnect_interval_s = reconnect_interval_s
        self._channel: grpc.Channel | None = None
        self._requests: queue.Queue | None = None
        self._responses: queue.Queue = queue.Queue()
        self._step = 0
        self._last_attempt = 0.0
        self._synced: dict[str, int | None] = {}  # seq_id -> tokens the draft holds (OUT_OF_STEP above)
        self._connect_lock = threading.Lock()
        # Releases not yet acknowledged: a timed-out or failed Release is retried on its own
        # timer with backoff (idle or not), and with the next Release or step; guarded by
        # _release_lock, as gRPC callbacks and the timer touch them.
        self._release_lock = threading.Lock()
        self._unreleased: dict[str, None] = {}  # ordered: oldest first
        self._releasing = False
        self._retry_timer: threading.Timer | None = None
        self._retry_delay = RELEASE_RETRY_MIN_S
        self._closed = False
        self._connecting = False
        self.connected = False
        self.available = True  # a real service (speculation/no_draft_service.py: none)

    def connect(self) -> None:
        """Starts connecting in the background (the engine calls this when it starts)."""
        self._ensure_stream()

    # ---- engine thread API --------------------------------------------------
    def synced_tokens(self, seq_id: str) -> int | None:
        """How many of the sequence's committed tokens the draft holds on this stream; None when
        the next request must carry its whole history (new, released or out of step)."""
        return self._synced.get(seq_id)

    def propose(self, requests: list[DraftRequest]) -> dict[str, DraftTree | None] | None:
        """One batched proposal. None = the whole step falls back (service down or late).

        In the returned dict a None value means that sequence's tree was invalid.
        """
        ids = [r.seq_id for r in requests]
        self._send_releases()  # retries earlier Releases that failed
        if not requests or not self._ensure_stream():
            self._unsync(ids)
            return None
        # Out of step (a failed step, a new stream): drop what the draft may hold, then resend all.
        stale = [i for i in ids if i in self._synced and self._synced[i] is OUT_OF_STEP]
        if stale and not self._release_now(stale):
            self._unsync(ids)
            return None
        self._step += 1
        message = draft_service_pb2.ProposeStreamRequest(step=self._step,
                                                         sequences=[self._message(r) for r in requests])
        self._requests.put(message)
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                response = self._responses.get(timeout=max(remaining, 0.0))
            except queue.Empty:
                log.warning("draft step %d missed its %.0f ms deadline", self._step, self.timeout_s * 1000)
                self._unsync(ids)
                return None
            if isinstance(response, Exception):
                self._drop_stream(response)
                self._unsync(ids)
                return None
            if response.step == self._step:
                break  # older answers arrived after their deadline: skip them
        answered = {tree.sequence_id for tree in response.trees}
        # A sequence without a tree was refused by the draft on its own (it kept nothing new of
        # it): resend its whole history next time; the others are in step.
        for r in requests:
            self._synced[r.seq_id] = len(r.token_ids) if r.seq_id in answered else OUT_OF_STEP
        return self._check(requests, response)

    def release(self, seq_ids: list[str]) -> None:
        """Drops draft state for finished sequences, without waiting.

        A Release that fails or times out is sent again with the next one (or at the next
        step) until the draft acknowledges it; the draft also expires idle sequences.
        """
        seq_ids = [i for i in seq_ids if i in self._synced]
        for seq_id in seq_ids:
            del self._synced[seq_id]
        if seq_ids:
            with self._release_lock:
                self._unreleased.update(dict.fromkeys(seq_ids))
                while len(self._unreleased) > MAX_UNRELEASED:  # the draft's TTL covers the rest
                    del self._unreleased[next(iter(self._unreleased))]
        self._send_releases()

    @property
    def num_unreleased(self) -> int:
        with self._release_lock:
            return len(self._unreleased)

    def close(self) -> None:
        with self._release_lock:
            self._closed = True
            if self._retry_timer is not None:
                self._retry_timer.cancel()
        self._drop_stream(None)

    # ---- helpers ----------------------------------------------------------
    def _message(self, request: DraftRequest):
        """The request's DraftSequence: the tokens the draft has not seen (all of them, with the
        trace context, when it holds none in step)."""
        synced = self._synced.get(request.seq_id)
        full = synced is OUT_OF_STEP
        sampling, seed = request.sampling, request.draft_seed
        return draft_service_pb2.DraftSequence(
            sequence_id=request.seq_id, new_token_ids=request.token_ids if full else request.token_ids[synced:],
            method=request.method, max_depth=request.max_depth, max_nodes=request.max_nodes,
            tenant_salt=request.tenant_salt, traceparent=traceparent(request.span_context) if full else "",
            temperature=0.0 if sampling is None or sampling.greedy else sampling.temperature,
            top_k=0 if sampling is None else sampling.top_k, top_p=0.0 if sampling is None else sampling.top_p,
            seed=(seed or 0) % 2**64, has_seed=seed is not None,
            features=None if request.features is None else feature_rows.encode(*request.features))

    def _ensure_stream(self) -> bool:
        """True when the stream is up; otherwise starts a background (re)connect and returns False.

        The engine thread never waits for a connection: steps fall back until it is ready.
        """
        with self._connect_lock:
            if self.connected:
                return True
            now = time.monotonic()
            if self._connecting or now - self._last_attempt < self.reconnect_interval_s:
                return False
            self._last_attempt, self._connecting = now, True
        threading.Thread(target=self._connect, daemon=True, name="specmesh-draft-connect").start()
        return False

    def _connect(self) -> None:
        channel = internal_sync_channel(self.address, self.tls)
        try:
            grpc.channel_ready_future(channel).result(timeout=max(self.reconnect_interval_s, 1.0))
        except grpc.FutureTimeoutError:
            channel.close()
            with self._connect_lock:
                self._connecting = False
            return
        requests: queue.Queue = queue.Queue()
        responses: queue.Queue = queue.Queue()
        stub = draft_service_pb2_grpc.DraftServiceStub(channel)
        stream = stub.ProposeStream(iter(requests.get, None))
        threading.Thread(target=self._read, args=(stream, responses), daemon=True,
                         name="specmesh-draft-reader").start()
        with self._connect_lock:
            self._channel, self._requests, self._responses = channel, requests, responses
            self.connected, self._connecting = True, False
        log.info("draft stream connected to %s", self.address)

    @staticmethod
    def _read(stream, responses: queue.Queue) -> None:
        try:
            for response in stream:
                responses.put(response)
            responses.put(ConnectionError("draft stream ended"))
        except grpc.RpcError as exc:
            responses.put(exc)

    def _drop_stream(self, reason: Exception | None) -> None:
        if reason is not None:
            log.warning("draft stream lost: %s", getattr(reason, "details", lambda: reason)())
        with self._connect_lock:
            requests, channel = self._requests, self._channel
            self._channel, self._requests, self.connected = None, None, False
            self._last_attempt = time.monotonic()
        # A new stream may reach a new draft server: resend everything (releasing it first).
        self._synced = dict.fromkeys(self._synced, OUT_OF_STEP)
        if requests is not None:
            requests.put(None)  # ends the request iterator
        if channel is not None:
            channel.close()

    def _send_releases(self) -> None:
        """Sends every unacknowledged release in one Release call, one call at a time."""
        channel = self._channel
        with self._release_lock:
            if self._releasing or not self._unreleased:
                return
            if channel is None:  # the stream is down: retried once it is back
                self._schedule_retry()
                return
            self._releasing = True
            batch = list(self._unreleased)
        stub = draft_service_pb2_grpc.DraftServiceStub(channel)
        try:
            future = stub.Release.future(draft_service_pb2.ReleaseRequest(sequence_ids=batch),
                                         timeout=self.timeout_s)
        except Exception:  # e.g. the channel was closed meanwhile
            with self._release_lock:
                self._releasing = False
                self._schedule_retry()
            return
        future.add_done_callback(lambda f: self._released(batch, f))

    def _schedule_retry(self) -> None:
        """One retry timer at a time, backing off to RELEASE_RETRY_MAX_S (_release_lock held)."""
        if self._retry_timer is not None or self._closed:
            return
        delay, self._retry_delay = self._retry_delay, min(self._retry_delay * 2, RELEASE_RETRY_MAX_S)
        self._retry_timer = threading.Timer(delay, self._retry_releases)
        self._retry_timer.daemon = True
        self._retry_timer.start()

    def _retry_releases(self) -> None:
        """Timer thread: reconnects if the stream is down, then sends what is unacknowledged."""
        with self._release_lock:
            self._retry_timer = None
        if self._channel is None:
            self._ensure_stream()  # in the background; the next retry finds it up
        self._send_releases()

    def _released(self, batch: list[str], future) -> None:
        """gRPC callback thread: forget acknowledged ids; failed ones wait for the next try."""
        failed = future.exception() is not None
        with self._release_lock:
            self._releasing = False
            if failed:
                self._schedule_retry()
            else:
                self._retry_delay = RELEASE_RETRY_MIN_S
                for seq_id in batch:
                    self._unreleased.pop(seq_id, None)
            more = bool(self._unreleased) and not failed
        if failed:
            log.info("draft Release of %d sequences failed (%s); retrying in the background",
                     len(batch), getattr(future.exception(), "code", lambda: "error")())
        elif more:
            self._send_releases()

    def _release_now(self, seq_ids: list[str]) -> bool:
        """Releases out-of-step sequences before their full history is sent again."""
        stub = draft_service_pb2_grpc.DraftServiceStub(self._channel)
        try:
            stub.Release(draft_service_pb2.ReleaseRequest(sequence_ids=seq_ids), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            self._drop_stream(exc)
            return False
        for seq_id in seq_ids:
            self._synced.pop(seq_id, None)  # the draft holds nothing of them now
        return True

    def _unsync(self, seq_ids: list[str]) -> None:
        """The draft's state for these may be partial: resend in full (after a Release) next time."""
        self._synced.update(dict.fromkeys(seq_ids, OUT_OF_STEP))

    def _check(self, requests: list[DraftRequest], response) -> dict[str, DraftTree | None]:
        wanted = {r.seq_id: r for r in requests}
        out: dict[str, DraftTree | None] = {seq_id: None for seq_id in wanted}
        for tree in response.trees:
            request = wanted.get(tree.sequence_id)
            if request is None:
                continue
            out[tree.sequence_id] = self._valid(tree, request)
        return out

    def _valid(self, message, request: DraftRequest) -> DraftTree | None:
        """The tree if it is usable for this request: in the vocabulary and within the limits."""
        try:
            tree = DraftTree.from_proto(message)  # checks parents come before children
        except ValueError:
            return None
        if tree.num_nodes > max(request.max_nodes, request.max_depth):
            return None
        if any(not 0 <= t < self.vocab_size for t in tree.token_ids):
            return None
        if tree.num_nodes and max(tree.depths) > request.max_depth:
            return None
        return tree


def draft_seed(generator_seed: int) -> int:
    """The draft sampler's seed for a sequence whose own generator has `generator_seed`: fixed by
    it (seeded requests stay reproducible; each of n samples drafts its own way) yet unrelated
    to its stream, since the draft's choices must not depend on the target's uniforms."""
    digest = hashlib.blake2b(f"specmesh-draft-{generator_seed}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def traceparent(span_context) -> str:
    """W3C traceparent of the request's span, so the draft service's spans join its trace."""
    if span_context is None or not span_context.is_valid:
        return ""
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{int(span_context.trace_flags):02x}"
