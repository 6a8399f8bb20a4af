"""Constraint -> compiled grammar (xgrammar), once per (tokenizer, constraint).

`ConstraintCompiler.compile(spec)` (async) returns a `CompiledGrammar` or raises
`ConstraintError(field, reason)`. Compilation runs on the compiler's own worker threads,
never on the engine thread or the event loop (xgrammar releases the GIL while it compiles),
and is bounded: `timeout_s` per compile (a timed-out constraint is remembered and refused
at once afterwards, so a pathological schema costs one worker for one compile, not one per
request) and `max_grammar_bytes` for the compiled grammar.

Cache: an LRU in memory of at most `cache_bytes` (xgrammar's own size estimate), keyed by
(tokenizer identity, kind, text), with one compile in flight per key; and, when `cache_dir`
is set, the compiled grammars as files there (xgrammar's serialization, which checks the
tokenizer's metadata when read back), so a restarted replica does not recompile them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from pathlib import Path

import xgrammar as xgr

from services.common.constraints import ConstraintSpec, constraint_violations
from services.target.structured.utf8_guard import Utf8Guard

log = logging.getLogger(__name__)
_LOCATION = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")


class ConstraintError(ValueError):
    """A constraint that cannot be served (INVALID_ARGUMENT naming `field`)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


class ConstraintCompiler:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, *, timeout_s: float = 10.0,
                 max_grammar_bytes: int = 64 << 20, cache_bytes: int = 256 << 20,
                 cache_dir: Path | None = None, workers: int = 2) -> None:
        """`vocab_size`: the model's logit width (may exceed the tokenizer's vocabulary)."""
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self.utf8_guard = Utf8Guard(self.info.decoded_vocab, vocab_size)  # every grammar state's
        self.tokenizer_id = tokenizer_identity(tokenizer, vocab_size, stop_token_ids)
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.max_grammar_bytes = max_grammar_bytes
        self.cache_bytes = cache_bytes
        self.cache_dir = Path(cache_dir) if cache_dir else None
        # xgrammar's cache is off: ours is keyed by tokenizer too, bounded, and persistent.
        self._xgr = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._lock = threading.RLock()  # a future done already runs its callback at once
        self._cache: OrderedDict[tuple, xgr.CompiledGrammar] = OrderedDict()
        self._cached_bytes = 0
        self._in_flight: dict[tuple, concurrent.futures.Future] = {}
        self._refused: dict[tuple, ConstraintError] = {}  # timed out or oversized: never again
        self.compiles = 0  # grammars compiled (not read from a cache), for tests and metrics

    def encode(self, text: str) -> list[int]:
        """The tokenizer's ids for `text` (no special tokens): how the model writes it."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def key(self, spec: ConstraintSpec) -> tuple:
        return (self.tokenizer_id, spec.kind, spec.text)

    async def compile(self, spec: ConstraintSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`; raises ConstraintError."""
        problems = constraint_violations(spec)
        if problems:
            raise ConstraintError(*problems[0])
        key = self.key(spec)
        with self._lock:
            if key in self._refused:
                raise self._refused[key]
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            future = self._in_flight.get(key)
            if future is None:
                future = self._pool.submit(self._compile_and_check, spec)
                self._in_flight[key] = future
                future.add_done_callback(lambda f, key=key: self._done(key, f))
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout_s)
        except asyncio.TimeoutError:
            error = ConstraintError(spec.field, f"compiling it took longer than {self.timeout_s:g} s")
            with self._lock:
                self._refused[key] = error
            raise error from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- helpers (worker threads) ------------------------------------------
    def _done(self, key: tuple, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._in_flight.pop(key, None)
            if future.cancelled():
                return
            error = future.exception()
            if isinstance(error, ConstraintError) and "limit" in error.reason:
                self._refused[key] = error
            elif error is None:
                self._store(key, future.result())

    def _compile_and_check(self, spec: ConstraintSpec) -> xgr.CompiledGrammar:
        compiled = self._read_file(spec)
        if compiled is None:
            try:
                compiled = self._compile(spec)
            except RuntimeError as exc:  # xgrammar's parse / conversion errors
                raise ConstraintError(spec.field, _reason(exc)) from None
            self.compiles += 1
            size = compiled.memory_size_bytes
            if size > self.max_grammar_bytes:
                raise ConstraintError(spec.field, f"the compiled grammar takes {size} bytes; the "
                                      f"limit is {self.max_grammar_bytes}")
            self._write_file(spec, compiled)
        if not _admits_output(compiled, self.vocab_size):
            raise ConstraintError(spec.field, "the constraint admits no output at all (it never matches)")
        return compiled

    def _compile(self, spec: ConstraintSpec) -> xgr.CompiledGrammar:
        # Compact JSON (no free whitespace): keys, separators and quotes are then forced,
        # which is what grammar drafts propose.
        if spec.kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(spec.text, any_whitespace=False, strict_mode=True)
            return self._xgr.compile_grammar(_json_string_chars(grammar))
        if spec.kind == "json_object":
            return self._xgr.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                 strict_mode=False)
        if spec.kind == "regex":
            return self._xgr.compile_regex(spec.text)
        if spec.kind == "choice":
            body = " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choices())
            return self._xgr.compile_grammar(f"root ::= {body}")
        return self._xgr.compile_grammar(spec.text)

    def _store(self, key: tuple, compiled: xgr.CompiledGrammar) -> None:
        """LRU insert under the byte limit (lock held)."""
        size = compiled.memory_size_bytes
        if size > self.cache_bytes:
            return
        self._cache[key] = compiled
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= old.memory_size_bytes

    def _path(self, spec: ConstraintSpec) -> Path | None:
        if self.cache_dir is None:
            return None
        digest = hashlib.sha256(json.dumps(self.key(spec)).encode()).hexdigest()
        return self.cache_dir / f"{digest}.json"

    def _read_file(self, spec: ConstraintSpec) -> xgr.CompiledGrammar | None:
        path = self._path(spec)
        if path is None or not path.exists():
            return None
        try:
            return xgr.CompiledGrammar.deserialize_json(path.read_text(), self.info)
        except Exception:  # stale or foreign file: recompile (and overwrite it)
            log.warning("compiled grammar %s unreadable; recompiling", path)
            return None

    def _write_file(self, spec: ConstraintSpec, compiled: xgr.CompiledGrammar) -> None:
        path = self._path(spec)
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp-{threading.get_ident()}")
        tmp.write_text(compiled.serialize_json())
        tmp.replace(path)


def tokenizer_identity(tokenizer, vocab_size: int, stop_token_ids) -> str:
    """sha256 of the vocabulary (token -> id), the logit width and the stop tokens."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    blob = json.dumps([vocab, vocab_size, sorted(stop_token_ids)], ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


# xgrammar 0.2.9 writes the characters of a length-limited JSON string (minLength /
# maxLength) as [^"\\\r\n], which admits raw control characters that JSON forbids (and no
# escapes). They become the characters JSON allows unescaped; escapes stay out (a narrower
# grammar: still valid JSON).
_LOOSE_STRING_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_STRING_CHARS = '[^\\0-\\x1f\\"\\\\]'


def json_schema_ebnf(schema_text: str) -> str:
    """The EBNF (xgrammar's dialect, rule `root`) of compact JSON valid under a schema, as the
    target compiles `json_schema` constraints: for grammars built around JSON values (tool
    calls among free text). Raises RuntimeError for a schema xgrammar cannot convert."""
    return str(_json_string_chars(xgr.Grammar.from_json_schema(
        schema_text, any_whitespace=False, strict_mode=True)))


def _json_string_chars(grammar: xgr.Grammar) -> xgr.Grammar | str:
    text = str(grammar)
    return text.replace(_LOOSE_STRING_CHARS, _JSON_STRING_CHARS) if _LOOSE_STRING_CHARS in text else grammar


def _admits_output(compiled: xgr.CompiledGrammar, vocab_size: int) -> bool:
    """True when the grammar allows some first token (a stop token counts: empty output)."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _reason(exc: Exception) -> str:
    """xgrammar's message without its time and source-location prefix."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return _LOCATION.sub("", text).strip()
