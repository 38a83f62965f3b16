"""The reference policy server's generation engine: batched sampling with a KV cache on one
engine thread, per-request sampling parameters, raw logprobs (as vLLM reports them), and vLLM's
pause modes.

Requests that arrive while a batch runs wait for the next batch (static batching): simple, and
on a tiny model a batch of 16 costs about what one request does. Not a production server.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from darl.serving.errors import ServingError
from darl.workflows.training_config import ServerPauseMode

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort"]
# A temperature below this samples greedily (vLLM's `_SAMPLING_EPS`): dividing by less would
# take the logits past float range.
GREEDY_BELOW = 1e-5


class GenerationRejectedError(ServingError, ValueError):
    """A request the engine cannot serve (prompt too long, bad parameters). `param` names the
    request field at fault and `value` its value, as vLLM's `VLLMValidationError` does: its
    message then ends with ` (parameter=..., value=...)`, and the error body says `param`."""

    def __init__(self, message: str, *, param: str | None = None, value: object = None) -> None:
        said = [f"{k}={v}" for k, v in (("parameter", param), ("value", value)) if v is not None]
        super().__init__(f"{message} ({', '.join(said)})" if said else message)
        self.param = param


class ContextLengthExceededError(GenerationRejectedError):
    """A prompt longer than the model's context, in vLLM 0.32's words (its renderer's token
    length check), so clients that recognise vLLM's and OpenAI's overflow recognise it.
    vLLM tokenizes a text prompt no further than one token past the context, so it counts
    "at least" that many; so does this (vLLM counts a prompt of token ids in full)."""

    def __init__(self, prompt_tokens: int, max_model_len: int) -> None:
        counted = min(prompt_tokens, max_model_len + 1)
        at_least = "at least " if counted == max_model_len + 1 else ""
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt contains {at_least}{counted} input tokens, which exceeds this limit even "
            "without any output tokens. Please reduce the length of the input prompt.",
            param="input_tokens",
            value=counted,
        )
        self.prompt_tokens = prompt_tokens
        self.max_model_len = max_model_len


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    top_logprobs: int = 0
    ignore_eos: bool = False


@dataclass(frozen=True)
class TokenStep:
    """One generated token: its id, its logprob, the top alternatives, the text it adds."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    text: str


@dataclass
class Sequence:
    """One sequence being generated. `events` receives `(index, TokenStep)` for each token and
    then `(index, FinishReason)`, or `(index, "error: ...")` if generation failed; the choices of
    one request share the queue."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    cancelled: bool = False
    # The tokens this sequence may sample next, given those it has generated (None: any);
    # how structured output (a forced tool call) constrains decoding.
    allowed_tokens: Callable[[list[int]], list[int]] | None = None
    _emitted_text: str = ""

    def emit(self, item: TokenStep | str) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (self.index, item))


class GenerationEngine:
    def __init__(
        self,
        model: Qwen2ForCausalLM,
        tokenizer: PreTrainedTokenizerFast,
        max_batch: int = 32,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_model_len = int(model.config.max_position_embeddings)
        self.eos_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
        self._pending: queue.Queue[Sequence | None] = queue.Queue()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        # The pause mode and the admission of a batch change together under this lock.
        self._cond = threading.Condition()
        self.pause_mode: ServerPauseMode | None = None
        self._idle = threading.Event()  # set while no batch is being generated
        self._idle.set()
        self._stopped = False
        self._default_generator = torch.Generator().manual_seed(seed)
        self._thread = threading.Thread(target=self._run, name="darl-generation", daemon=True)

    # --- control (any thread) ------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._pending.put(None)
        self._thread.join(timeout=10)

    def submit(self, sequence: Sequence) -> None:
        """Queue a sequence. As vLLM does, a prompt over the context is refused
        (ContextLengthExceededError) and `max_tokens` is cut to the room the prompt leaves
        (the answer then ends with finish_reason "length"); a prompt that fills the context
        leaves no room for one token (GenerationRejectedError)."""
        room = self.max_model_len - len(sequence.prompt_ids)
        if room < 0:
            raise ContextLengthExceededError(len(sequence.prompt_ids), self.max_model_len)
        if room == 0:
            raise GenerationRejectedError(
                "max_tokens must be at least 1, got 0.", param="max_tokens", value=0
            )
        if sequence.params.max_tokens > room:
            sequence.params = replace(sequence.params, max_tokens=room)
        try:
            self._generator(sequence)
        except (RuntimeError, OverflowError, ValueError) as err:
            raise GenerationRejectedError(
                f"seed {sequence.params.seed} cannot seed the sampler: {err}",
                param="seed",
                value=sequence.params.seed,
            ) from err
        self._pending.put(sequence)

    def pause(self, mode: ServerPauseMode) -> None:
        """`keep`: freeze running sequences, continue them on resume. `abort`: end them now with
        finish_reason "abort". `wait`: let them finish (see `wait_idle`). New requests wait for
        resume in all three."""
        with self._cond:
            self.pause_mode = mode
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self.pause_mode = None
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Block until no batch is being generated (after `pause("wait")`: drained)."""
        return self._idle.wait(timeout)

    @property
    def paused(self) -> bool:
        return self.pause_mode is not None

    def run_between_steps(self, command: Callable[[], None]) -> None:
        """Run `command` on the engine thread between decode steps (e.g. loading weights)."""
        self._commands.put(command)
        self._pending.put(None)  # wake an idle engine

    # --- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stopped:
            self._run_commands()
            first = self._pending.get()
            if first is None:
                continue
            if self._hold(admitting=True):
                return  # stopped
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._pending.get_nowait()
                except queue.Empty:
                    break
                if nxt is not None:
                    batch.append(nxt)
            batch = [s for s in batch if not s.cancelled]
            try:
                if batch:
                    self._generate(batch)
            except Exception as err:
                # The engine thread must outlive a failed batch; every waiter hears of it.
                log.exception("generation failed")
                for seq in batch:
                    if seq.finish_reason is None:
                        seq.emit(f"error: {err!r}")
            finally:
                self._idle.set()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _hold(self, admitting: bool) -> bool:
        """Wait while the pause mode holds the engine; True when the sequences in flight must
        end now (abort, or the engine stops). Before a new batch (`admitting`) any pause
        holds; within a batch `keep` freezes, `wait` goes on and `abort` ends it. Admitting a
        batch marks the engine busy under the same lock, so `wait_idle` never misses it."""
        while True:
            self._run_commands()
            with self._cond:
                if self._stopped:
                    return True
                mode = self.pause_mode
                if mode is None or (not admitting and mode == "wait"):
                    if admitting:
                        self._idle.clear()
                    return False
                if not admitting and mode == "abort":
                    return True
                self._cond.wait(timeout=0.05)

    def _generate(self, batch: list[Sequence]) -> None:
        model = self.model
        width = max(len(s.prompt_ids) for s in batch)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.tensor(
            [[pad] * (width - len(s.prompt_ids)) + s.prompt_ids for s in batch]
        )
        mask = torch.tensor(
            [[0] * (width - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in batch]
        )
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        generators = [self._generator(s) for s in batch]
        out = model(
            input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True
        )
        cache = out.past_key_values
        logits = out.logits[:, -1, :]
        active = list(range(len(batch)))
        while active:
            tokens = self._sample(batch, logits, generators, active)
            for i in active:
                if batch[i].cancelled and batch[i].finish_reason is None:
                    self._finish(batch[i], "abort")
            active = [i for i in active if batch[i].finish_reason is None]
            if not active:
                break
            if self._hold(admitting=False):
                for i in active:
                    self._finish(batch[i], "abort")
                break
            mask = torch.cat([mask, torch.ones(len(batch), 1, dtype=mask.dtype)], dim=-1)
            positions = positions[:, -1:] + 1
            out = model(
                input_ids=tokens.unsqueeze(-1),
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
            )
            cache = out.past_key_values
            logits = out.logits[:, -1, :]

    def _generator(self, seq: Sequence) -> torch.Generator:
        """The sequence's own random stream when it asks for a seed (one torch takes: a seed
        of a request the API took but torch refuses fails at submit, never a batch)."""
        if seq.params.seed is None:
            return self._default_generator
        return torch.Generator().manual_seed(seq.params.seed)

    def _sample(
        self,
        batch: list[Sequence],
        logits: torch.Tensor,
        generators: list[torch.Generator],
        active: list[int],
    ) -> torch.Tensor:
        batch_logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = torch.full((len(batch),), self.tokenizer.pad_token_id, dtype=torch.long)
        for i in active:
            try:
                chosen[i] = self._sample_one(batch[i], logits[i], batch_logprobs[i], generators[i])
            except (RuntimeError, ValueError, IndexError) as err:
                # This sequence's own failure: the others in the batch go on.
                log.exception("sampling one sequence failed")
                batch[i].finish_reason = "abort"
                batch[i].emit(f"error: {err!r}")
        return chosen

    def _sample_one(
        self,
        seq: Sequence,
        row: torch.Tensor,
        logprobs: torch.Tensor,
        generator: torch.Generator,
    ) -> int:
        if seq.allowed_tokens is not None:
            # Logprobs of the logits sampled from, before temperature (vLLM's default
            # `raw_logprobs`): vLLM masks a structured output's logits before its sampler,
            # so a forced token has logprob 0.0. Unconstrained, these are the model's own
            # logprobs, what the trainer recomputes.
            row = self._constrain(row.float(), seq.allowed_tokens(seq.token_ids))
            logprobs = torch.log_softmax(row, dim=-1)
        token = self._pick(seq.params, row, generator)
        k = min(seq.params.top_logprobs, logprobs.numel())
        top = []
        if k > 0:
            values, ids = logprobs.topk(k)
            # A masked-out token (-inf) is no alternative (and no JSON number).
            top = [(t, v) for t, v in zip(ids.tolist(), values.tolist(), strict=True) if v > -1e30]
        self._append(seq, token, float(logprobs[token]), top)
        return token

    def _constrain(self, row: torch.Tensor, allowed: list[int]) -> torch.Tensor:
        """The row with every token but `allowed` masked out (only EOS when none is)."""
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[allowed or [self.tokenizer.eos_token_id]] = True
        return row.masked_fill(~keep, float("-inf"))

    @staticmethod
    def _pick(params: SamplingParams, logits: torch.Tensor, generator: torch.Generator) -> int:
        if params.temperature < GREEDY_BELOW:
            return int(logits.argmax())
        scaled = logits.float() / params.temperature
        if params.top_k > 0:
            kth = scaled.topk(min(params.top_k, scaled.numel())).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(-1) - sorted_probs > params.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=generator))

    def _append(self, seq: Sequence, token: int, logprob: float, top: list) -> None:
        seq.token_ids.append(token)
        params = seq.params
        finish: FinishReason | None = None
        is_eos = token in self.eos_ids and not params.ignore_eos
        if is_eos or token in params.stop_token_ids:
            finish = "stop"
        else:
            # A list of ids decodes to one str (the annotation also covers batches).
            seq.text = str(
                self.tokenizer.decode(
                    [t for t in seq.token_ids if t not in self.eos_ids], skip_special_tokens=True
                )
            )
            for stop in params.stop:
                at = seq.text.find(stop, max(0, len(seq._emitted_text) - len(stop)))
                if at >= 0:
                    seq.text = seq.text[:at]
                    finish = "stop"
                    break
        if finish is None and len(seq.token_ids) >= params.max_tokens:
            finish = "length"
        # Hold back text that may be the start of a stop string or of a multi-byte character.
        ready = seq.text if finish else self._safe_prefix(seq.text, params.stop)
        delta = ready[len(seq._emitted_text) :] if ready.startswith(seq._emitted_text) else ""
        seq._emitted_text += delta
        seq.emit(TokenStep(token_id=token, logprob=logprob, top=top, text=delta))
        if finish is not None:
            self._finish(seq, finish)

    @staticmethod
    def _safe_prefix(text: str, stops: tuple[str, ...]) -> str:
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        for stop in stops:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if text[:end].endswith(stop[:n]):
                    end -= n
                    break
        return text[:end]

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        seq.emit(reason)
