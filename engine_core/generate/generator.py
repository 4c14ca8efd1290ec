"""Continuous batching: many sequences share each decode step of one engine, joining and leaving between steps.

One thread owns the engine's context and the KV cache. Each iteration it
1. drops cancelled sequences (their blocks go back to the pool), waiting, part-prefilled or decoding,
2. gives every decoding sequence whose next token passes its last block a new block (``BlockAccounting.grow``);
   when the pool has none (cached prefixes no one holds evicted first), it preempts the most recently admitted
   running sequences, the growing one included when it is the newest, until the block is free: their blocks are
   freed and they go back to the front of the queue (oldest first),
3. admits waiting sequences, oldest first, while the batch has room and the pool has blocks for a sequence's
   prompt plus its first new token (blocks come as tokens do, vLLM's way: a sequence holds what it wrote, not the
   ``max_tokens`` it may never reach, so many more run at once); with prefix caching (on by default, as vLLM's),
   the cached blocks its prompt starts with are shared rather than taken, and its prefill starts after them
   (kv_cache.py's module docstring),
4. runs one batched prefill step: the next chunk of the prompts not yet fed, oldest first, as many as fit in
   ``max_prefill_tokens`` token slots (rows times the longest chunk, pads included); a sequence whose last chunk is
   in samples its first token (its chunks' blocks were all taken at admission),
5. runs one batched decode step for every sequence that had a token and nothing left to prefill when the
   iteration began (one new token each).
A preempted sequence is recomputed when it is admitted again (vLLM's preemption by recompute): its prefill feeds
its prompt and every token it generated but the last (chunked like any prompt; the prefix cache may hold its
prompt's blocks still), samples nothing, and decoding goes on from its last token. Its tokens were sent already and
its ``Sampler`` (penalty counts, seeded generator) never saw the preemption, so its tokens are those it would have
generated without one. ``submit`` refuses a sequence whose prompt + ``max_tokens`` the whole pool cannot hold, so
the oldest running sequence always gets its blocks and finishes.
Prefilling many prompts in one run keeps the time to a first token from growing with the queue (one engine run per
prompt would), and the budget bounds how long one iteration's prefill delays the decoding sequences' next token: a
prompt longer than it is fed over several iterations, each chunk after the ones before it (from the pool).
A sequence ends on an eos token (unless ``ignore_eos``), one of its ``stop_token_ids`` or ``max_tokens``; its
blocks are freed at once and the next waiting sequence may take them in the next iteration. Each sequence's
``Sampler`` knows its prompt and keeps its own token counts (penalties), and hands back the log-probabilities its
request asks for with the token; the events carry them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from engine_core.generate.decoder import DecoderRunner
from engine_core.generate.kv_cache import PromptBlocks
from engine_core.generate.sampling import Sampler, SamplingParams, StepSampler, TokenLogprobs
from engine_core.runtime import CudaEngine

#: the share of the KV pool admission leaves free while sequences run (vLLM's default watermark)
WATERMARK = 0.01
log = logging.getLogger("kiln.generate")


@dataclass(frozen=True)
class GenerationEvent:
    """One step of one sequence. ``token_id`` is a new token of the completion, or None on a final event that adds
    none: "stop" (the eos or stop token that ended the sequence is counted in ``completion_tokens`` but is not part
    of the text), "cancelled" and "error". A "length" final event carries the last token. ``logprobs``: the token's
    log-probabilities, when the request's ``SamplingParams.logprobs`` asks for them."""

    token_id: int | None
    finish_reason: str | None  # None while going; "stop", "length", "cancelled", "error"
    prompt_tokens: int
    completion_tokens: int
    error: BaseException | None = None
    logprobs: TokenLogprobs | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None


class GenerationHandle:
    """The submitter's hold on a sequence."""

    def __init__(self, wake: threading.Condition) -> None:
        self._wake = wake
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """Stop the sequence at the next step boundary (thread-safe, idempotent): its blocks are freed and its last
        event is a final "cancelled" (unless it ended first)."""
        self._cancelled.set()
        with self._wake:
            self._wake.notify_all()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass(frozen=True)
class GeneratorStats:
    running: int
    waiting: int
    kv_blocks_used: int  # held by sequences
    kv_blocks_total: int
    prompt_tokens_total: int
    completion_tokens_total: int
    kv_blocks_cached: int = 0  # held by none, keeping a cached prefix (evictable)
    prefix_cache_queries_total: int = 0  # prompt tokens of admitted sequences looked up in the prefix cache
    prefix_cache_hits_total: int = 0  # prompt tokens found there: their keys and values were not computed again
    preemptions_total: int = 0  # running sequences whose blocks were freed for an older one's (recomputed later)


@dataclass(eq=False)
class _Sequence:
    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    on_event: Callable[[GenerationEvent], None]
    handle: GenerationHandle
    sampler: Sampler
    blocks: PromptBlocks | None  # ``feed``'s blocks for the prefix cache (None: prefix caching off)
    feed: tuple[int, ...]  # what its prefill feeds: the prompt, or after a preemption the prompt + generated[:-1]
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0  # tokens of ``feed`` in the KV cache
    admitted: bool = False  # once: its prompt is counted in the statistics
    done: bool = False

    @property
    def admission_tokens(self) -> int:
        """Tokens its blocks hold when it is admitted: what it prefills and the next token's row."""
        return len(self.feed) + 1

    @property
    def unfed(self) -> int:
        """Tokens of ``feed`` still to prefill."""
        return len(self.feed) - self.prefilled


def plan_prefill(pending: Sequence[tuple[int, int]], budget: int, max_context: int) -> list[int]:
    """Chunk lengths for one prefill run over the first ``len(result)`` of ``pending`` ((tokens cached, tokens still
    to feed) per sequence, oldest first): the run pads every chunk to the longest, so it is charged rows x longest
    against ``budget``, and the plan feeds the most real tokens within that (fewer rows on a tie: longer chunks for
    the oldest). The longest cached past plus the longest chunk stays within ``max_context``."""
    best: list[int] = []
    longest_left = longest_past = 0
    for rows, (past, left) in enumerate(pending[:budget], 1):
        longest_left, longest_past = max(longest_left, left), max(longest_past, past)
        width = min(budget // rows, longest_left, max_context - longest_past)
        chunks = [min(left, width) for _, left in pending[:rows]]
        if sum(chunks) > sum(best):
            best = chunks
    return best


class Generator:
    """Serves generation requests on one decoder engine with continuous batching in a thread of its own (named
    ``name``). ``max_batch_size`` sequences decode together; each may hold ``max_context`` tokens (prompt +
    completion); the KV cache has ``num_blocks`` blocks of ``block_tokens`` tokens (default: enough for a full
    batch of full contexts). One iteration's prefill run feeds at most ``max_prefill_tokens`` token slots (its rows
    times its longest chunk): the most a waiting prompt delays the running sequences' next token, and what a long
    prompt is cut into. ``enable_prefix_caching`` shares the KV blocks of prompt prefixes computed before (the
    module docstring). ``warm_up`` (a CUDA engine) captures every shape bucket's CUDA graph before the loop starts
    (``DecoderRunner.warm_up``), so no live step stalls on a first capture; ``warm_up_seconds`` says how long it
    took."""

    def __init__(self, engine: CudaEngine, *, max_batch_size: int, max_context: int, eos_token_ids: Collection[int],
                 block_tokens: int = 16, num_blocks: int | None = None, max_prefill_tokens: int = 512,
                 enable_prefix_caching: bool = True, warm_up: bool = True, name: str = "generator") -> None:
        self._runner = DecoderRunner(engine)
        if not 1 <= max_batch_size <= self._runner.max_batch_size or not 2 <= max_context <= self._runner.max_context:
            raise ValueError(f"max_batch_size {max_batch_size} and max_context {max_context} must be within the "
                             f"engine's profile: {self._runner.max_batch_size} sequences, {self._runner.max_context} "
                             f"tokens")
        if max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be at least 1, not {max_prefill_tokens}")
        self.max_batch_size, self.max_context = max_batch_size, max_context
        self.max_prefill_tokens = max_prefill_tokens
        self.prefix_caching = enable_prefix_caching
        self.vocab_size = self._runner.signature.vocab_size
        self._eos = frozenset(int(t) for t in eos_token_ids)
        blocks_per_context = -(-max_context // block_tokens)
        self._pool = self._runner.new_pool(block_tokens=block_tokens,
                                           num_blocks=num_blocks or max_batch_size * blocks_per_context)
        self._lock = threading.Condition()
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._ids = itertools.count()
        self._closed = False
        self._prompt_tokens = self._completion_tokens = 0
        self._prefix_queries = self._prefix_hits = self._preemptions = 0
        self._sampling = StepSampler()
        started = time.perf_counter()
        #: shape buckets captured before serving (0: a host engine, or ``warm_up`` off)
        try:
            self.warmed_shapes = self._runner.warm_up(self._pool, max_prefill_tokens) if warm_up else 0
        except BaseException:
            self._release()
            raise
        self.warm_up_seconds = time.perf_counter() - started
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- the submitters' side ------------------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: SamplingParams,
               on_event: Callable[[GenerationEvent], None]) -> GenerationHandle:
        """Queue a sequence; ``on_event`` is called from the generator's thread once per token, the last event
        final. ValueError (a message for the client) for an empty prompt, ids outside the vocabulary, or a
        prompt + max_tokens longer than the context or the whole KV cache; RuntimeError once closed."""
        tokens = self._check(prompt, params)
        handle = GenerationHandle(self._lock)
        blocks = PromptBlocks.of(tokens, self._pool.block_tokens) if self.prefix_caching else None
        seq = _Sequence(next(self._ids), tokens, params, on_event, handle, Sampler(params, tokens), blocks, tokens)
        with self._lock:
            if self._closed:
                raise RuntimeError("the generator is closed")
            self._waiting.append(seq)
            self._lock.notify_all()
        return handle

    def _check(self, prompt: Sequence[int], params: SamplingParams) -> tuple[int, ...]:
        tokens = tuple(int(t) for t in prompt)
        if not tokens:
            raise ValueError("the prompt is empty")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        total = len(tokens) + params.max_tokens
        if total > self.max_context:
            raise ValueError(f"the prompt's {len(tokens)} tokens + max_tokens {params.max_tokens} exceed the "
                             f"model's context of {self.max_context} tokens")
        blocks = self._pool.blocks_for(total)
        if blocks > self._pool.total_blocks:
            raise ValueError(f"the prompt's {len(tokens)} tokens + max_tokens {params.max_tokens} need {blocks} KV "
                             f"cache blocks; the cache has {self._pool.total_blocks}")
        return tokens

    def stats(self) -> GeneratorStats:
        with self._lock:
            return GeneratorStats(running=len(self._running), waiting=len(self._waiting),
                                  kv_blocks_used=self._pool.used_blocks, kv_blocks_total=self._pool.total_blocks,
                                  prompt_tokens_total=self._prompt_tokens,
                                  completion_tokens_total=self._completion_tokens,
                                  kv_blocks_cached=self._pool.cached_blocks,
                                  prefix_cache_queries_total=self._prefix_queries,
                                  prefix_cache_hits_total=self._prefix_hits,
                                  preemptions_total=self._preemptions)

    def close(self) -> None:
        """Stop the thread; sequences still running or waiting get a final "cancelled", and the device memory of
        a CUDA engine's KV cache is freed. Idempotent."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()
            self._sampling.close()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the generator's thread ------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while self._wait_for_work():
            try:
                self._drop_cancelled()
                decoding = self._grow([s for s in self._running if s.generated and not s.unfed])
                self._admit()
                self._prefill()
                self._decode([s for s in decoding if not s.done])
            except Exception as e:  # a bug in the loop itself: end what runs rather than hang its clients
                log.exception("generator loop failed")
                for seq in list(self._running):
                    self._finish(seq, "error", error=e)
                self._forget_done()
        with self._lock:
            left = [*self._running, *self._waiting]
            self._waiting.clear()
        for seq in left:
            self._finish(seq, "cancelled")
        self._forget_done()
        self._release()

    def _release(self) -> None:
        """Free what the loop held outside Python's memory (the device KV cache and the engine's buffers) in the
        thread that used it, once nothing runs: an unloaded model gives its device memory back at once."""
        self._runner.close()
        self._pool.close()

    def _wait_for_work(self) -> bool:
        with self._lock:
            while not self._closed and not self._waiting and not self._running:
                self._lock.wait()
            return not self._closed

    def _drop_cancelled(self) -> None:
        with self._lock:
            dropped = [s for s in self._waiting if s.handle.cancelled]
            for seq in dropped:
                self._waiting.remove(seq)
        for seq in [*dropped, *(s for s in self._running if s.handle.cancelled)]:
            self._finish(seq, "cancelled")
        self._forget_done()

    def _grow(self, decoding: list[_Sequence]) -> list[_Sequence]:
        """A block for each of ``decoding`` whose next token passes its last one, oldest first; while the pool has
        none, preempt the newest running sequence (the module docstring). The sequences of ``decoding`` still
        running."""
        with self._lock:
            for seq in decoding:
                while seq.id in self._pool and not self._pool.grow(seq.id, self._pool.length(seq.id) + 1):
                    self._preempt(self._running[-1])  # a preempted sequence holds no blocks: not in the pool
            return [s for s in decoding if s.id in self._pool]

    def _preempt(self, seq: _Sequence) -> None:
        """Free ``seq``'s blocks and queue it first, to prefill its prompt and generated tokens again (all but the
        last, which its next decode step feeds). Called with the lock held."""
        self._pool.free(seq.id)
        self._running.remove(seq)
        self._waiting.appendleft(seq)
        self._preemptions += 1
        seq.feed = seq.prompt + tuple(seq.generated[:-1])
        seq.prefilled = 0
        seq.blocks = PromptBlocks.of(seq.feed, self._pool.block_tokens) if self.prefix_caching else None
        log.debug("preempted sequence %d after %d tokens", seq.id, len(seq.generated))

    def _admit(self) -> None:
        """Take the oldest waiting sequences' first blocks (cached prompt blocks shared: their prefill starts after
        them) while the batch has room and the pool blocks (cached blocks no one holds count as free), keeping
        WATERMARK of the pool free while others run (vLLM's watermark: a sequence admitted into the last blocks would
        soon be preempted by the running ones' growth, its prefill wasted)."""
        spare = int(WATERMARK * self._pool.total_blocks)
        with self._lock:
            while self._waiting and len(self._running) < self.max_batch_size and (
                    self._pool.fits(self._waiting[0].admission_tokens, self._waiting[0].blocks,
                                    spare if self._running else 0)):
                seq = self._waiting.popleft()
                seq.prefilled = self._pool.reserve(seq.id, seq.admission_tokens, seq.blocks)
                self._running.append(seq)
                if not seq.admitted:  # a recomputed sequence's prompt is not counted again
                    seq.admitted = True
                    self._prompt_tokens += len(seq.prompt)
                    if seq.blocks is not None:
                        self._prefix_queries += len(seq.prompt)
                        self._prefix_hits += seq.prefilled

    def _prefill(self) -> None:
        """One batched run over the next chunks of the running sequences' unfed prompts (``plan_prefill``); a
        sequence whose prompt is in samples its first token (a recomputed one none: it has its tokens)."""
        pending = [s for s in self._running if s.unfed]
        chunks = plan_prefill([(s.prefilled, s.unfed) for s in pending], self.max_prefill_tokens, self.max_context)
        if not chunks:
            return
        batch = pending[:len(chunks)]
        try:
            logits = self._runner.prefill(self._pool, [s.id for s in batch],
                                          [s.feed[s.prefilled:s.prefilled + n] for s, n in zip(batch, chunks)],
                                          copy=False)  # sampled before the next step
        except Exception as e:
            for seq in batch:
                self._finish(seq, "error", error=e)
        else:
            for seq, n in zip(batch, chunks):
                seq.prefilled += n
            done = [i for i, seq in enumerate(batch) if not seq.unfed and not seq.generated]
            choices = self._sampling.choose([batch[i].sampler for i in done], logits[done])
            for i, choice in zip(done, choices):
                self._accept(batch[i], *choice)
        self._forget_done()

    def _decode(self, batch: list[_Sequence]) -> None:
        if not batch:
            return
        try:
            greedy = all(s.sampler.plain_greedy for s in batch)  # then only the argmax crosses to the host
            out = self._runner.decode(self._pool, [s.id for s in batch], [s.generated[-1] for s in batch],
                                      copy=False, argmax=greedy)
        except Exception as e:
            for seq in batch:
                self._finish(seq, "error", error=e)
        else:
            choices = [(int(t), None) for t in out] if greedy else \
                self._sampling.choose([s.sampler for s in batch], out)
            for seq, choice in zip(batch, choices):
                self._accept(seq, *choice)
        self._forget_done()

    def _accept(self, seq: _Sequence, token: int, logprobs: TokenLogprobs | None = None) -> None:
        """Record ``token`` for ``seq`` and tell its submitter: a new token, or the end of the sequence."""
        seq.generated.append(token)
        with self._lock:
            self._completion_tokens += 1
        params = seq.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self._eos):
            self._finish(seq, "stop")
        elif len(seq.generated) >= params.max_tokens:
            self._finish(seq, "length", token=token, logprobs=logprobs)
        else:
            self._emit(seq, GenerationEvent(token, None, len(seq.prompt), len(seq.generated), logprobs=logprobs))

    def _finish(self, seq: _Sequence, reason: str, token: int | None = None, error: BaseException | None = None,
                logprobs: TokenLogprobs | None = None) -> None:
        """End ``seq``: free its blocks and send its final event (``_forget_done`` takes it off the lists)."""
        if seq.done:
            return
        seq.done = True
        with self._lock:
            self._pool.free(seq.id)
        self._emit(seq, GenerationEvent(token, reason, len(seq.prompt), len(seq.generated), error, logprobs))

    def _emit(self, seq: _Sequence, event: GenerationEvent) -> None:
        try:
            seq.on_event(event)
        except Exception:  # a broken consumer ends its own sequence, not the loop
            log.exception("generation event handler failed; the sequence is dropped")
            seq.done = True
            with self._lock:
                self._pool.free(seq.id)

    def _forget_done(self) -> None:
        with self._lock:
            self._running = [s for s in self._running if not s.done]
