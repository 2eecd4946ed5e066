"""``ModelRunner``: the engine's compute side (implements ``runner.Runner``).

It owns what every model shares — request validation, sampling, the finishing rules
(``sequences``) and the updates — and hands the KV cache and the forward passes to a backend:

* the architectures of ``models.registry`` (Llama, Mistral, Qwen2, SmolLM, Qwen3;
  ``registry.unsupported_reason`` says which) run on ``paged.backend.PagedBackend``: our
  forward (the registered ``models`` class) over a paged KV cache, chunked prefill mixed
  with decode under a token budget, preemption instead of out-of-memory, CUDA graphs for
  decode on a GPU;
* every other architecture runs on ``hf_backend.HFBackend`` (transformers' forward over a
  left-padded batched cache), and the start-up log says so and why.

The backend schedules, runs the model and samples; the runner applies the finishing rules to
what it sampled and tells it which sequences finished.

Both compute, for every request, exactly what it would compute alone: greedy output equals
``model.generate`` for that prompt, token for token (CPU fp32).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import time
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dpserve.block_hash import BlockHash
from dpserve.engine.backend import Backend
from dpserve.engine.defaults import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_HF_MAX_NUM_SEQS,
    default_max_num_batched_tokens,
)
from dpserve.engine.hf_backend import HFBackend
from dpserve.engine.kv_events import KVEvent
from dpserve.engine.layers.weight_format import DEFAULT_WEIGHT_FORMAT, WeightFormatRefused, checked
from dpserve.engine.lora.serving import (
    NO_ADAPTERS,
    AdapterError,
    AdapterReport,
    unknown_adapter,
)
from dpserve.engine.lora.slots import LoraSlots
from dpserve.engine.models.registry import unsupported_reason
from dpserve.engine.paged.backend import PagedBackend, PagedConfig
from dpserve.engine.runner import RequestRejected, RunnerRequest, TokenUpdate, check_tokens_fit
from dpserve.engine.sample.constraint_compiler import ConstraintCompiler
from dpserve.engine.sample.grammar import (
    GrammarError,
    Grammars,
    GrammarUnavailable,
    advance,
    failure,
)
from dpserve.engine.sequences import Sequence, decode_new_tokens
from dpserve.limits import DEFAULT_LORA_LIMITS, DEFAULT_REQUEST_LIMITS, RequestLimits
from dpserve.model_loading import load_model_and_tokenizer, pick_device_and_dtype, resolve_model
from dpserve.protocol import ErrorCode
from dpserve.tokenizer import as_batch_tokenizer, prepare_detokenizing

log = logging.getLogger(__name__)

BACKENDS = ("auto", "paged", "transformers")


class ModelRunner:
    """Continuous batching over one model.

    ``model_path_or_id``: a local transformers directory, a hub id, or ``DEFAULT_MODEL``
    (resolved by ``dpserve.model_loading.resolve_model``). ``max_num_seqs``: sequences running at
    once (the engine's capacity); by default derived from the KV pool (paged backend) or
    ``DEFAULT_HF_MAX_NUM_SEQS`` (transformers fallback). ``max_num_batched_tokens``: tokens one
    step computes (prefill chunks + decodes), ``default_max_num_batched_tokens`` of the device
    by default. ``kv_cache_bytes``: the pool's size (default 1 GiB on CPU; on CUDA
    ``gpu_memory_utilization`` of the device minus weights and activations). ``block_size``:
    tokens per KV block. ``backend``: "auto" (paged for the Llama family, else transformers),
    "paged" or "transformers". ``overlap``: prepare step N+1 on the host while step N runs
    (paged backend; default: on CUDA only). ``dtype`` / ``device``:
    "auto" is bf16 on CUDA, fp32 on CPU. ``gguf_file`` loads a GGUF file inside
    ``model_path_or_id`` directly. ``prefix_caching``: share the KV blocks of equal prompt
    prefixes between requests (paged backend only; ``paged.block_pool.BlockPool``).
    ``cpu_weights``: how a CPU model's projection weights are held, fp32 / bf16 / int8
    (``layers.weight_format``; not fp32: CPU, fp32 model, paged backend, else
    ``WeightFormatRefused``).
    """

    def __init__(
        self,
        model_path_or_id: str,
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        dtype: str = "auto",
        device: str = "auto",
        gguf_file: str | None = None,
        attn_implementation: str = "sdpa",
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_cache_bytes: int | None = None,
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
        cuda_graphs: bool = True,
        overlap: bool | None = None,
        backend: str = "auto",
        prefix_caching: bool = True,
        limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
        enable_lora: bool = False,
        max_loras: int = DEFAULT_LORA_LIMITS.max_loras,
        max_lora_rank: int = DEFAULT_LORA_LIMITS.max_lora_rank,
        lora_modules: Mapping[str, str] | None = None,
        cpu_weights: str = DEFAULT_WEIGHT_FORMAT,
    ) -> None:
        if (max_num_seqs is not None and max_num_seqs < 1) or backend not in BACKENDS:
            raise ValueError(
                f"need max_num_seqs >= 1 (got {max_num_seqs}) and a backend in "
                f"{BACKENDS} (got {backend!r})"
            )
        if max_num_batched_tokens is not None and max_num_batched_tokens < 1:
            raise ValueError(f"need max_num_batched_tokens >= 1 (got {max_num_batched_tokens})")
        self.model_path = resolve_model(model_path_or_id)
        self._dtype_name = dtype
        self._device_name = device
        self._gguf_file = gguf_file
        self._attn_implementation = attn_implementation
        self.device, self.dtype = pick_device_and_dtype(device, dtype)
        self.cpu_weights = checked(cpu_weights, device_type=self.device.type, dtype=self.dtype)
        if self.device.type == "cuda" and self.device.index is not None:
            # Streams, CUDA graphs and Triton launches follow the current device.
            torch.cuda.set_device(self.device)

        self.model: Any = None
        self.tokenizer: Any = None
        hf_model = self._load()
        self._text_tokenizer = as_batch_tokenizer(self.tokenizer)
        prepare_detokenizing(self._text_tokenizer)
        self.vocab_size: int = int(hf_model.get_input_embeddings().num_embeddings)
        # Ends a request whose params name no termination_id (read when a request is added).
        self.eos_token_ids: frozenset[int] = _find_eos_ids(hf_model, self.tokenizer)
        self.eos_token_id = _main_eos_id(self.tokenizer, self.eos_token_ids)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = default_max_num_batched_tokens(self.device.type)
        self.backend: Backend = self._make_backend(
            hf_model,
            backend,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            paged=PagedConfig(
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                kv_cache_bytes=kv_cache_bytes,
                gpu_memory_utilization=gpu_memory_utilization,
                cuda_graphs=cuda_graphs,
                overlap=overlap,
                prefix_caching=prefix_caching,
                weight_format=self.cpu_weights,
            ),
        )
        self.max_num_seqs: int = self.backend.max_num_seqs
        self.context_size: int = self.backend.context_size
        _return_freed_heap()
        facts = ", ".join(f"{key} {value}" for key, value in self.backend.describe().items())
        log.info("model %s on %s (%s): %s", self.model_path, self.device, self.dtype, facts)
        # Built on the first structured request (llguidance reads the whole vocabulary once);
        # why it cannot be built, once that was found.
        self._limits = limits
        self._grammars: Grammars | None = None
        self._grammars_unavailable: str | None = None
        self._compiler = ConstraintCompiler(
            self._compile_matcher, limits.constraint_compile_timeout
        )
        self._arrived_done: list[Sequence] = []  # resumed with nothing left to generate
        self._live: dict[int, Sequence] = {}  # every sequence the backend has, by request id
        self._with_stop_text: set[int] = set()  # those of them with stop strings
        self._released = False
        self._tokens_generated = 0
        self._steps = 0
        # LoRA adapters (None: not enabled), and the sequences waiting for a slot of theirs.
        self.adapters: LoraSlots | None = None
        self._awaiting_slot: deque[Sequence] = deque()
        self._adapter_names_served: set[str] = set()  # every name an adapter was loaded as
        if enable_lora or lora_modules:
            self._enable_lora(max_loras, max_lora_rank, lora_modules or {})

    def _enable_lora(self, max_loras: int, max_rank: int, modules: Mapping[str, str]) -> None:
        if not isinstance(self.backend, PagedBackend):
            raise ValueError(
                f"LoRA adapters need the paged backend; {self.model_path} runs on the "
                "transformers fallback"
            )
        self.adapters = self.backend.enable_lora(max_loras, max_rank)
        for name, path in modules.items():
            self.load_adapter(name, path)

    # ----------------------------------------------------------------------------- loading

    def _load(self) -> Any:
        model, tokenizer = load_model_and_tokenizer(
            self.model_path,
            self._dtype_name,
            self._device_name,
            gguf_file=self._gguf_file,
            attn_implementation=self._attn_implementation,
        )
        if self.tokenizer is None:  # keep the first tokenizer: callers may hold it
            self.tokenizer = tokenizer
        return model

    def _make_backend(
        self,
        model: Any,
        backend: str,
        *,
        max_num_seqs: int | None,
        max_num_batched_tokens: int,
        paged: PagedConfig,
    ) -> Backend:
        reason = unsupported_reason(model)
        if backend == "paged" and reason is not None:
            raise ValueError(f"the paged backend cannot run {self.model_path}: {reason}")
        if backend != "transformers" and reason is None:
            paged_backend = PagedBackend(model, paged)
            self.model = paged_backend.model
            return paged_backend
        if paged.weight_format != DEFAULT_WEIGHT_FORMAT:
            raise WeightFormatRefused(
                f"--cpu-weights {paged.weight_format} needs the paged backend; "
                f"{self.model_path} runs on the transformers fallback"
                + (f" ({reason})" if reason is not None else "")
            )
        if backend == "auto":
            log.warning(
                "%s: serving through the transformers fallback (no paged KV cache, no CUDA "
                "graphs, no chunked prefill): %s",
                self.model_path,
                reason,
            )
        self.model = model
        pad_candidates = (self.tokenizer.pad_token_id, self.eos_token_id, 0)
        return HFBackend(
            model,
            max_num_seqs=max_num_seqs or DEFAULT_HF_MAX_NUM_SEQS,
            max_num_batched_tokens=max_num_batched_tokens,
            # Fills the left padding of a prefill batch; masked, so any valid id works.
            pad_id=next(i for i in pad_candidates if i is not None),
        )

    def release(self) -> None:
        """Free the model and the KV cache; running requests go back to the front of the queue
        with their generated tokens, and are recomputed (prompt + generated) after reload."""
        if self._released:
            return
        self.backend.release()
        self.model = None
        self._released = True
        _return_freed_heap()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def reload(self) -> None:
        if not self._released:
            return
        model = self._load()
        self.backend.reload(model)
        self.model = self.backend.model
        self._released = False
        _return_freed_heap()

    # ------------------------------------------------------------------------ LoRA adapters

    def load_adapter(self, name: str, path: str) -> None:
        """Register LoRA adapter ``name`` from ``path`` (``AdapterError`` if it cannot run
        here); one registered under that name already is replaced."""
        if self.adapters is None:
            raise AdapterError(self._no_adapters())
        self.adapters.register(name, path)
        # Blocks cached under a name served before hold what earlier weights computed: the
        # new ones must never find them (the name is in every block hash, not the weights).
        if name in self._adapter_names_served and isinstance(self.backend, PagedBackend):
            self.backend.forget_cached_prefixes()
        self._adapter_names_served.add(name)

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (``KeyError`` if unknown, ``AdapterError`` while in use)."""
        if self.adapters is None:
            raise KeyError(name)
        self.adapters.unregister(name)

    def adapter_report(self) -> AdapterReport | None:
        if self.adapters is None:
            return None
        running_ids: set[int] = set()
        if isinstance(self.backend, PagedBackend) and self.backend.scheduler is not None:
            running_ids = {id(sequence) for sequence in self.backend.scheduler.running}
        running: Counter[str] = Counter()
        waiting: Counter[str] = Counter()
        for sequence in [*self._live.values(), *self._awaiting_slot]:
            name = sequence.params.lora_name
            if name is not None:
                (running if id(sequence) in running_ids else waiting)[name] += 1
        loaded = set(self.adapters.loaded())
        return AdapterReport(
            self.adapters.max_loras,
            {
                name: (name in loaded, running[name], waiting[name])
                for name in self.adapters.names()
            },
        )

    def _no_adapters(self) -> str:
        if not isinstance(self.backend, PagedBackend):
            return (
                "LoRA adapters need the paged backend; this model runs on the transformers fallback"
            )
        return NO_ADAPTERS

    def _check_adapter(self, name: str) -> None:
        if self.adapters is None:
            raise RequestRejected(ErrorCode.BAD_REQUEST, self._no_adapters())
        if name not in self.adapters.paths:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST, unknown_adapter(name, self.adapters.names())
            )

    # ---------------------------------------------------------------------------- requests

    def add(self, request: RunnerRequest) -> None:
        self._validate(request)
        params = request.params
        sequence = Sequence.arriving(
            request, self.eos_token_ids, self.context_size, self._text_tokenizer
        )
        if len(sequence.tokens) >= sequence.max_generated:
            self._arrived_done.append(sequence)  # generated elsewhere already: nothing to do
        elif params.guided:
            # Compiled off the step loop; admitted to the backend by a later step (``_admit``).
            self._check_constraint(sequence)
            self._compiler.submit(sequence)
        else:
            self._admit(sequence)

    def _admit(self, sequence: Sequence) -> None:
        """Hand the sequence to the backend once its adapter (if any) has a slot; until then,
        or if its adapter failed to load, it waits here (``_admit_awaiting`` admits or fails
        it at the next step)."""
        name = sequence.params.lora_name
        if name is not None:
            try:
                slot = self._acquire(name)
            except AdapterError:
                slot = None  # failed at the next step, with the reason
            if slot is None:
                self._awaiting_slot.append(sequence)
                return
            sequence.lora_slot = slot
        self._hand_to_backend(sequence)

    def _hand_to_backend(self, sequence: Sequence) -> None:
        self.backend.add(sequence)
        self._live[sequence.request_id] = sequence
        if sequence.stop_text is not None:
            self._with_stop_text.add(sequence.request_id)

    def _acquire(self, name: str) -> int | None:
        assert self.adapters is not None  # _validate refuses adapter requests without it
        try:
            return self.adapters.acquire(name)
        except KeyError:
            raise AdapterError(f"LoRA adapter {name!r} was unloaded") from None

    def _admit_awaiting(self) -> list[TokenUpdate]:
        """Admit the sequences waiting for an adapter slot, oldest first, whose adapter is
        loaded or finds a slot now; one whose adapter was unloaded or no longer loads fails."""
        failed: list[TokenUpdate] = []
        still: deque[Sequence] = deque()
        for sequence in self._awaiting_slot:
            name = sequence.params.lora_name
            assert name is not None
            try:
                slot = self._acquire(name)
            except AdapterError as exc:
                update = TokenUpdate(
                    sequence.request_id, [], finish_reason=ErrorCode.BAD_REQUEST, error=str(exc)
                )
                failed.append(update)
                continue
            if slot is None:
                still.append(sequence)
                continue
            sequence.lora_slot = slot
            self._hand_to_backend(sequence)
        self._awaiting_slot = still
        return failed

    def _release_slot(self, sequence: Sequence) -> None:
        if sequence.lora_slot >= 0 and self.adapters is not None:
            self.adapters.release(sequence.lora_slot)
            sequence.lora_slot = -1

    def warm_up(self) -> None:
        """Builds the structured-output tables of the tokenizer (llguidance's, ~0.5 s for
        SmolLM2's 49k tokens, holding the GIL): built by the first structured request, they
        stalled every stream of the engine by ~0.9 s."""
        started = time.monotonic()
        with contextlib.suppress(RequestRejected):  # unavailable: logged, each such a 400
            self._grammars_for_requests()
            log.info("structured output's tables built in %.1f s", time.monotonic() - started)

    def _grammars_for_requests(self) -> Grammars:
        """The matcher factory, built once; a tokenizer llguidance cannot take refuses every
        structured request (400) before it is queued, never inside a step."""
        if self._grammars_unavailable is not None:
            raise RequestRejected(ErrorCode.BAD_REQUEST, self._grammars_unavailable)
        if self._grammars is None:
            try:
                self._grammars = Grammars(
                    self.tokenizer, self.vocab_size, self.eos_token_ids, self._limits
                )
            except GrammarUnavailable as exc:
                self._grammars_unavailable = str(exc)
                log.warning("%s", exc)
                raise RequestRejected(ErrorCode.BAD_REQUEST, str(exc)) from None
        return self._grammars

    def _check_constraint(self, sequence: Sequence) -> None:
        """What is cheap to check before the compile is queued: the tokenizer, the size."""
        try:
            self._grammars_for_requests().check_size(sequence.params)
        except GrammarError as exc:
            raise RequestRejected(ErrorCode.BAD_REQUEST, str(exc)) from None

    def _compile_matcher(self, sequence: Sequence) -> Any:
        """On a compile worker: the sequence's matcher, past the tokens it resumes after."""
        assert self._grammars is not None  # built by _check_constraint before the submit
        return self._grammars.matcher(sequence.params, sequence.tokens)

    def _collect_compiled(self) -> list[TokenUpdate]:
        """Admit the sequences whose constraint compiled; report the refused ones."""
        compiled = self._compiler.collect()
        for sequence in compiled.ready:
            self._admit(sequence)
        return [
            TokenUpdate(sequence.request_id, [], finish_reason=ErrorCode.BAD_REQUEST, error=why)
            for sequence, why in compiled.refused
        ]

    def _validate(self, request: RunnerRequest) -> None:
        check_tokens_fit(request, self.context_size, self.vocab_size)
        if request.params.lora_name is not None:
            self._check_adapter(request.params.lora_name)
        if request.params.prompt_logprobs and not self.backend.computes_prompt_logprobs:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                "prompt log-probs (echo with logprobs) need the paged Llama backend; this model "
                "runs on the transformers fallback",
            )

    def cancel(self, request_id: int) -> None:
        if self._compiler.cancel(request_id):
            return
        for queue in (self._arrived_done, self._awaiting_slot):
            for sequence in queue:
                if sequence.request_id == request_id:
                    queue.remove(sequence)
                    return
        live = self._live.pop(request_id, None)
        if live is not None:
            self._release_slot(live)
        self._with_stop_text.discard(request_id)
        with torch.inference_mode():  # the HF batch's tensors are inference tensors
            self.backend.cancel(request_id)

    def unreported(self) -> list[TokenUpdate]:
        return [update for sequence in self._live.values() if (update := sequence.unreported())]

    def has_work(self) -> bool:
        return (
            bool(self._arrived_done or self._awaiting_slot)
            or self._compiler.pending()
            or self.backend.has_work()
        )

    # -------------------------------------------------------------------- prefix cache

    @property
    def kv_block_size(self) -> int | None:
        """Tokens per block of the prefix cache; None without one (transformers fallback)."""
        if isinstance(self.backend, PagedBackend) and self.backend.config.prefix_caching:
            return self.backend.kv_block_size
        return None

    def kv_events(self) -> list[KVEvent]:
        return self.backend.kv_events() if isinstance(self.backend, PagedBackend) else []

    def kv_snapshot(self) -> list[BlockHash]:
        return self.backend.kv_snapshot() if isinstance(self.backend, PagedBackend) else []

    def stats(self) -> dict[str, Any]:
        lora = {}
        if self.adapters is not None:
            lora = {
                "lora_max_loras": self.adapters.max_loras,
                "lora_loaded": len(self.adapters.loaded()),
                "lora_registered": len(self.adapters.paths),
                "lora_loads": self.adapters.loads,
                "lora_evictions": self.adapters.evictions,
                "lora_awaiting_slot": len(self._awaiting_slot),
            }
        return {
            **self.backend.describe(),
            **self.backend.stats(),
            **lora,
            "tokens_generated": self._tokens_generated,
            "steps": self._steps,
            "released": self._released,
        }

    # ---------------------------------------------------------------------------- stepping

    def step(self) -> list[TokenUpdate]:
        """Schedule, run the model, sample, retire the finished. Does nothing while released
        (requests stay queued until ``reload``)."""
        if self._released:
            return []
        self._steps += 1
        updates = [s.emit(len(s.tokens), "length") for s in self._arrived_done]
        self._arrived_done = []
        if self._awaiting_slot:
            updates += self._admit_awaiting()
        if self._compiler.pending():
            if not self.backend.has_work() and not updates:
                self._compiler.wait(0.01)  # nothing else to run: no spinning meanwhile
            updates += self._collect_compiled()
        if not self.backend.has_work():
            return updates
        with torch.inference_mode():
            for sampled in self.backend.step():
                finished = []
                if self._with_stop_text:
                    decode_new_tokens(sampled.sequences, sampled.tokens)
                logprobs, tops = sampled.logprobs, sampled.top
                # accept() keeps its token unless the sequence finishes with "stop" (a stop
                # token is not returned; a stop string cuts the token it starts in): every
                # other row adds one generated token.
                stopped = 0
                pairs = zip(sampled.sequences, sampled.tokens, strict=True)
                bare = logprobs is None and tops is None
                for row, (sequence, token) in enumerate(pairs):
                    if sequence.matcher is not None:
                        broken = self._follow_constraint(sequence, token)
                        if broken is not None:
                            updates.append(broken)
                            finished.append(sequence)
                            stopped += 1  # its token is not reported: not counted either
                            continue
                    if bare:
                        update = sequence.accept(token, None)
                    else:
                        update = sequence.accept(
                            token,
                            None if logprobs is None else logprobs[row],
                            None if tops is None else tops[row],
                        )
                    if update is not None:
                        updates.append(update)
                        if update.finish_reason is not None:
                            finished.append(sequence)
                            stopped += update.finish_reason == "stop"
                self._tokens_generated += len(sampled.tokens) - stopped
                if finished:
                    for sequence in finished:
                        del self._live[sequence.request_id]
                        self._with_stop_text.discard(sequence.request_id)
                        self._release_slot(sequence)
                    self.backend.finish(finished)
        return updates

    @staticmethod
    def _follow_constraint(sequence: Sequence, token: int) -> TokenUpdate | None:
        """Feed the sampled token to the sequence's matcher. When llguidance reported an error
        (one of its limits, hit while computing the mask or taking the token), or the
        sequence is about to stop on a stop token where its document is not complete, the
        request fails with that error: its ``finish_reason`` is never "stop" on a document
        that does not follow its constraint."""
        matcher = sequence.matcher
        assert matcher is not None
        why = failure(matcher)
        if why is None and token in sequence.stop_ids and not matcher.is_accepting():
            why = (
                "the structured-output constraint failed during generation: a stop token came "
                "before the document was complete"
            )
        if why is None:
            advance(matcher, token)
            why = failure(matcher)
        if why is None:
            return None
        return TokenUpdate(sequence.request_id, [], finish_reason=ErrorCode.ENGINE_ERROR, error=why)


def _return_freed_heap() -> None:
    """Collects garbage, then hands the C heap's free memory back to the system (glibc's
    ``malloc_trim``; nothing where the C library has none). A load frees what it converted or
    packed (the loaded fp32 weights of a bf16 or int8 engine) in the middle of the heap, where
    glibc keeps it: SmolLM2-135M on CPU with ``--cpu-weights bf16``, RSS 1,252 MB after the
    load, 844 MB after this (int8 1,115 / 712; issue 33)."""
    gc.collect()
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _find_eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    configured = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif isinstance(configured, Iterable):
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _main_eos_id(tokenizer: Any, eos_token_ids: frozenset[int]) -> int | None:
    """The tokenizer's EOS id, else the smallest of the model's."""
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return min(eos_token_ids, default=None)
