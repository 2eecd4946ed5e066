"""``VllmRunner``: vLLM's v1 engine core as an engine's compute side (``runner.Runner``).

vLLM's ``EngineCore`` runs in this process through its in-process client (``InprocClient``):
each ``step`` is one vLLM scheduler step (schedule, forward on vLLM's workers, sample), so the
engine server interleaves its socket, heartbeats and stream flushes between steps exactly as
with dpserve's own runner. Requests go in as token ids (the coordinator tokenized them); what
vLLM samples comes back per token and goes through dpserve's finishing rules
(``sequences.Sequence``: EOS / ``termination_id``, ``min_tokens``, stop strings, length), so a
request's tokens, text and finish reason are what dpserve's engine gives for the same tokens.
A request that finishes by those rules is aborted in vLLM before its next step.

A re-dispatched request (``resume_tokens``: another engine generated them and died) continues
after them: vLLM gets prompt + resume tokens as its prompt and the tokens left to generate.

LoRA adapters (vLLM's ``--enable-lora``): registered by name (``load_adapter``, at start from
``--lora-modules`` or at run time), each one a ``LoRARequest`` with an id of its own that goes
with every request naming it; vLLM keeps up to ``--max-loras`` of them in its batch slots and
loads the others from their directories when a request needs them.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import shutil
import sys
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpserve.block_hash import BlockHash
from dpserve.engine.kv_events import KVEvent
from dpserve.engine.lora.serving import (
    NO_ADAPTERS,
    AdapterError,
    AdapterReport,
    unknown_adapter,
)
from dpserve.engine.runner import RequestRejected, RunnerRequest, TokenUpdate, check_tokens_fit
from dpserve.engine.sample.constraint_compiler import ConstraintCompiler
from dpserve.engine.sample.grammar import Grammars, GrammarUnavailable
from dpserve.engine.sequences import Sequence
from dpserve.engine.vllm.distribution import answer_vllm_version, installed_vllm_version
from dpserve.engine.vllm.engine_args import VllmOptions, engine_args
from dpserve.engine.vllm.kv_events import CollectedEvents, KVEventTranslator
from dpserve.engine.vllm.sampling import vllm_sampling_params
from dpserve.limits import DEFAULT_REQUEST_LIMITS, RequestLimits
from dpserve.model_loading import cache_dir
from dpserve.protocol import ErrorCode
from dpserve.tokenizer import as_batch_tokenizer, prepare_detokenizing

log = logging.getLogger(__name__)

# The start-up request (``VllmRunner.warm_up``) takes ~10 s where torch compiles cold on a
# slow CPU; past this, something is wrong and it is abandoned.
WARM_UP_TIMEOUT_S = 300.0

TopEntry = tuple[int, float]


class VllmRunner:
    """Continuous batching by vLLM over one model (``options``: ``engine_args.VllmOptions``)."""

    def __init__(
        self,
        options: VllmOptions,
        limits: RequestLimits = DEFAULT_REQUEST_LIMITS,
        lora_modules: Mapping[str, str] | None = None,
    ) -> None:
        answer_vllm_version()
        # vLLM's sampler compiles a few functions with torch's inductor (the sampled token's
        # rank among the log-probs, for any batch size). Into a cache of this install's own
        # (under dpserve's writable cache, keyed by the install's prefix: an image's /opt/venv
        # is read-only), never the machine-wide /tmp/torchinductor_<user> (set, not defaulted:
        # torch writes the variable into its process's environment when it first looks up its
        # cache, so a parent that ran torch hands its own default down), and without
        # inductor's precompiled header, which lives in /tmp whatever the cache: one left there
        # broken made every compile fail ("'at::vec' has not been declared") and killed the
        # engine's worker.
        install = hashlib.sha256(sys.prefix.encode()).hexdigest()[:16]
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "torchinductor" / install)
        os.environ["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] = "0"
        _compile_nothing_without_a_cpp_compiler()
        from transformers import AutoTokenizer
        from vllm.exceptions import VLLMClientError
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.core_client import InprocClient
        from vllm.v1.engine.input_processor import InputProcessor
        from vllm.v1.executor import Executor

        self.options = options
        self._limits = limits
        # What vLLM raises for a request it refuses: its validation errors (VLLMClientError,
        # not a ValueError in vLLM 0.32) and the ValueErrors of its other checks. Either is the
        # request's fault (400); anything else is the engine's (502, ``EngineServer``).
        self._refusals: tuple[type[Exception], ...] = (ValueError, VLLMClientError)
        config = engine_args(options).create_engine_config()
        self._config = config
        # Builds vLLM's engine core here and its model workers (their own processes on CPU,
        # and one per tensor-parallel rank).
        self._client = InprocClient(config, Executor.get_class(config), log_stats=True)
        self._core = self._client.engine_core
        self._inputs = InputProcessor(config, renderer_from_config(config))
        self._tasks = self._client.get_supported_tasks()
        model_config = config.model_config
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_config.tokenizer)
        self._text_tokenizer = as_batch_tokenizer(self.tokenizer)
        prepare_detokenizing(self._text_tokenizer)
        self.max_num_seqs: int = config.scheduler_config.max_num_seqs
        self.context_size: int = model_config.max_model_len
        self.vocab_size: int = model_config.get_vocab_size()
        self.eos_token_ids = _eos_token_ids(self.tokenizer, model_config.model)
        self._block_size: int = config.cache_config.block_size
        self._translator: KVEventTranslator | None = None
        self._collected: CollectedEvents | None = None
        if config.cache_config.enable_prefix_caching:
            self._translator = KVEventTranslator(self._block_size)
            self._collected = CollectedEvents()
            # vLLM's scheduler publishes its cache's events once per step to this publisher
            # (configured "null": nothing leaves the process).
            self._core.scheduler.kv_event_publisher = self._collected
        self._sleep_mode = bool(model_config.enable_sleep_mode)
        self._live: dict[int, Sequence] = {}  # running in vLLM, by dpserve request id
        self._vllm_ids: dict[int, str] = {}  # dpserve request id -> vLLM's
        self._by_vllm_id: dict[str, int] = {}
        self._arrived_done: list[Sequence] = []  # resumed with nothing left to generate
        # Structured requests while dpserve's checks of their constraint run (``add``).
        self._grammars: Grammars | None = None
        self._compiler = ConstraintCompiler(
            self._compile_matcher, limits.constraint_compile_timeout
        )
        self._compiling: dict[int, RunnerRequest] = {}
        self._next_id = itertools.count()
        self._released = False
        self._tokens_generated = 0
        self._steps = 0
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._lora = config.lora_config  # None: no adapters
        self._adapters: dict[str, Any] = {}  # name -> its vLLM LoRARequest
        self._adapter_ids = itertools.count(1)  # vLLM's adapter ids start at 1
        self._adapter_names_served: set[str] = set()
        log.info(
            "vLLM %s serving %s: tensor parallel %d, context %d, block size %d, max_num_seqs %d, "
            "prefix caching %s",
            installed_vllm_version(),
            model_config.model,
            config.parallel_config.tensor_parallel_size,
            self.context_size,
            self._block_size,
            self.max_num_seqs,
            "on" if self._translator is not None else "off",
        )
        if lora_modules and self._lora is None:
            raise ValueError("--lora-modules needs vLLM's LoRA support (--enable-lora)")
        for name, path in (lora_modules or {}).items():
            self.load_adapter(name, path)

    def warm_up(self) -> None:
        """What vLLM does on the first request of a kind, done here before the engine
        registers: each held every request of the engine meanwhile. Its CPU worker compiles
        the ranking of sampled and prompt tokens among the log-probs on first use (torch's
        inductor; its GPU worker warms that up at start): the first request asking for
        log-probs took 9.6 s on a 2-core Zen 3 with a cold compile cache, as a new pod has.
        Its structured-output backend builds the tokenizer's tables on the first constrained
        request (~0.9 s for SmolLM2's, every stream paused), as dpserve's own checks do
        (``_grammars_for_requests``). One request of two tokens asks for both; its prompt fills
        no KV block, so nothing reaches the prefix cache's events."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import StructuredOutputsParams

        started = time.monotonic()
        try:
            self._grammars_for_requests()
            structured = StructuredOutputsParams(json_object=True)
        except RequestRejected:  # each structured request will be a 400: nothing to warm
            structured = None
        params = VllmSamplingParams(
            max_tokens=1,
            logprobs=1,
            prompt_logprobs=1,
            ignore_eos=True,
            detokenize=False,
            structured_outputs=structured,
        )
        request = self._inputs.process_inputs(
            "dpserve-warm-up", {"prompt_token_ids": [0, 0]}, params, self._tasks
        )
        self._client.add_request(request)
        # vLLM compiles the constraint off its step: until then its steps return nothing.
        deadline = started + WARM_UP_TIMEOUT_S
        while not any(output.finished for output in self._client.get_output().outputs):
            if time.monotonic() > deadline:
                self._client.abort_requests([request.request_id])
                log.warning("the warm-up request did not finish in %g s", WARM_UP_TIMEOUT_S)
                return
        log.info("log-probs and structured output warmed up in %.1f s", time.monotonic() - started)

    # ---------------------------------------------------------------------------- requests

    def add(self, request: RunnerRequest) -> None:
        self._validate(request)
        sequence = Sequence.arriving(
            request, self.eos_token_ids, self.context_size, self._text_tokenizer
        )
        if sequence.max_generated - len(sequence.tokens) <= 0:
            self._arrived_done.append(sequence)  # generated elsewhere already: nothing to do
        elif request.params.guided:
            # Checked as dpserve's engine checks it (compile and first masks within the
            # limits), off the step loop; handed to vLLM by a later step (``_collect_compiled``).
            self._grammars_for_requests()
            self._compiler.submit(sequence)
            self._compiling[request.request_id] = request
        else:
            self._submit(request, sequence)

    def _submit(self, request: RunnerRequest, sequence: Sequence) -> None:
        """Hand the request to vLLM's engine core."""
        params = request.params
        vllm_id = f"{request.request_id}.{next(self._next_id)}"
        prompt: dict[str, Any] = {"prompt_token_ids": request.prompt_tokens + request.resume_tokens}
        if params.cache_salt:
            prompt["cache_salt"] = params.cache_salt
        adapter = None
        if params.lora_name is not None:
            self._check_adapter(params.lora_name)  # unloaded while its constraint compiled
            adapter = self._adapters[params.lora_name]
        left = sequence.max_generated - len(sequence.tokens)
        try:
            core_request = self._inputs.process_inputs(
                vllm_id,
                prompt,
                vllm_sampling_params(params, left, len(request.resume_tokens)),
                self._tasks,
                lora_request=adapter,
            )
        except self._refusals as exc:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST, f"vLLM refused the request: {exc}"
            ) from None
        self._client.add_request(core_request)
        self._live[request.request_id] = sequence
        self._vllm_ids[request.request_id] = vllm_id
        self._by_vllm_id[vllm_id] = request.request_id
        self._refresh_cached_prefix(vllm_id)

    def _refresh_cached_prefix(self, vllm_id: str) -> None:
        """dpserve's engine's rule for an arriving request (``paged.block_pool.BlockPool.
        refresh``) on vLLM's pool: the blocks of the request's longest cached prefix that no
        running request holds become the last of vLLM's free blocks to be evicted, the prefix's
        first block last of all. While the request waits in vLLM's queue, the requests admitted
        before it then evict other free blocks first, and the coordinator's index, which routed
        the request by those blocks' KV events, still predicts what it finds
        (tests/integration/test_vllm_prefix_refresh.py: 128 prefix tokens found, against 64 in
        vLLM's own order). It does not lift bench/prefix.py's saturated runs (4-8 req/s, pools
        of 24 blocks for 4 prefixes of 8): the index's accuracy there stayed 0.72-0.73
        (0.62-0.77 before), where a pool cannot hold every queued request's prefix at once.
        Models with several KV cache groups (hybrid attention) are left as they are."""
        scheduler = self._core.scheduler
        request = scheduler.requests.get(vllm_id)
        if (
            self._translator is None  # no prefix caching
            or request is None
            or len(scheduler.kv_cache_config.kv_cache_groups) != 1
        ):
            return
        pool = scheduler.kv_cache_manager.block_pool
        prefix = []
        for block_hash in request.block_hashes:
            cached = pool.get_cached_block(block_hash, [0])
            if cached is None:
                break
            prefix.append(cached[0])
        free = pool.free_block_queue
        for block in reversed(prefix):
            if block.ref_cnt == 0 and not block.is_null:
                free.remove(block)
                free.append(block)

    def _grammars_for_requests(self) -> Grammars:
        """dpserve's matcher factory for this tokenizer, built once (a tokenizer llguidance
        cannot take refuses every structured request, as on dpserve's engine)."""
        if self._grammars is None:
            try:
                self._grammars = Grammars(
                    self.tokenizer, self.vocab_size, self.eos_token_ids, self._limits
                )
            except GrammarUnavailable as exc:
                raise RequestRejected(ErrorCode.BAD_REQUEST, str(exc)) from None
        return self._grammars

    def _compile_matcher(self, sequence: Sequence) -> Any:
        """On a compile worker: dpserve's matcher for the request, past its resumed tokens,
        its first masks timed (``Grammars.matcher``); vLLM builds its own once this passed."""
        assert self._grammars is not None  # built by add before the submit
        return self._grammars.matcher(sequence.params, sequence.tokens)

    def _collect_compiled(self) -> list[TokenUpdate]:
        """Hand vLLM the requests whose constraint passed; report the refused ones."""
        compiled = self._compiler.collect()
        updates: list[TokenUpdate] = []
        for sequence in compiled.ready:
            sequence.matcher = None  # vLLM masks with its own
            request = self._compiling.pop(sequence.request_id)
            try:
                self._submit(request, sequence)
            except RequestRejected as exc:
                updates.append(
                    TokenUpdate(sequence.request_id, [], finish_reason=exc.code, error=exc.message)
                )
        for sequence, why in compiled.refused:
            del self._compiling[sequence.request_id]
            updates.append(
                TokenUpdate(sequence.request_id, [], finish_reason=ErrorCode.BAD_REQUEST, error=why)
            )
        return updates

    def _validate(self, request: RunnerRequest) -> None:
        check_tokens_fit(request, self.context_size, self.vocab_size)
        params = request.params
        if params.lora_name is not None:
            self._check_adapter(params.lora_name)
        constraint = params.guided_json or params.guided_regex or "".join(params.guided_choice)
        if len(constraint.encode()) > self._limits.max_constraint_bytes:
            raise RequestRejected(
                ErrorCode.BAD_REQUEST,
                f"the structured-output constraint has more than "
                f"{self._limits.max_constraint_bytes} bytes",
            )

    def cancel(self, request_id: int) -> None:
        if self._compiler.cancel(request_id):
            del self._compiling[request_id]
            return
        for sequence in self._arrived_done:
            if sequence.request_id == request_id:
                self._arrived_done.remove(sequence)
                return
        if self._live.pop(request_id, None) is not None:
            self._client.abort_requests([self._forget_vllm_id(request_id)])

    def _forget_vllm_id(self, request_id: int) -> str:
        vllm_id = self._vllm_ids.pop(request_id)
        del self._by_vllm_id[vllm_id]
        return vllm_id

    def has_work(self) -> bool:
        return bool(self._arrived_done) or bool(self._live) or self._compiler.pending()

    def unreported(self) -> list[TokenUpdate]:
        return [update for sequence in self._live.values() if (update := sequence.unreported())]

    # ---------------------------------------------------------------------------- stepping

    def step(self) -> list[TokenUpdate]:
        """One vLLM step; its tokens through the finishing rules. Nothing while released."""
        if self._released:
            return []
        self._steps += 1
        updates = [s.emit(len(s.tokens), "length") for s in self._arrived_done]
        self._arrived_done = []
        if self._compiler.pending():
            if not self._live and not updates:
                self._compiler.wait(0.01)  # nothing else to run: no spinning meanwhile
            updates += self._collect_compiled()
        if not self._live:
            return updates
        outputs = self._client.get_output()
        if outputs.scheduler_stats is not None:
            self._note_stats(outputs.scheduler_stats)
        finished: list[int] = []
        for output in outputs.outputs:
            request_id = self._by_vllm_id.get(output.request_id)
            sequence = None if request_id is None else self._live.get(request_id)
            if request_id is None or sequence is None:
                continue  # cancelled or finished here while vLLM still had it in a batch
            ended = self._take_output(sequence, output, updates)
            if ended:
                finished.append(request_id)
        if finished:
            still_in_vllm = []
            for request_id in finished:
                del self._live[request_id]
                still_in_vllm.append(self._forget_vllm_id(request_id))
            # Finished by dpserve's rules (a stop token or string): vLLM would go on to
            # max_tokens. Aborting one that vLLM finished too is a no-op there.
            self._client.abort_requests(still_in_vllm)
        return updates

    def _take_output(self, sequence: Sequence, output: Any, updates: list[TokenUpdate]) -> bool:
        """Apply one request's step output; True when the request ended."""
        if output.prefill_stats is not None and sequence.cached_prompt_tokens is None:
            sequence.cached_prompt_tokens = int(output.prefill_stats.num_cached_tokens)
        if output.new_prompt_logprobs_tensors is not None:
            self._record_prompt_logprobs(sequence, output.new_prompt_logprobs_tensors)
        rows = _logprob_rows(output.new_logprobs, len(output.new_token_ids))
        for index, token in enumerate(output.new_token_ids):
            logprob, top = rows[index] if rows is not None else (None, None)
            update = sequence.accept(token, logprob, top)
            if update is None:
                self._tokens_generated += 1
                continue
            updates.append(update)
            if update.finish_reason is None:
                self._tokens_generated += 1
                continue
            # A stop token or the token a stop string begins in is not returned.
            self._tokens_generated += update.finish_reason != "stop"
            return True
        reason = output.finish_reason
        if reason is None:
            return False
        # vLLM ended it where dpserve's rules did not: its own length limits (the model's
        # context), an abort of its own, or an error (a constraint it could not compile).
        if str(reason) == "length":  # vLLM's FinishReason prints as its OpenAI name
            updates.append(sequence.emit(len(sequence.tokens), "length"))
        else:
            updates.append(
                TokenUpdate(
                    sequence.request_id,
                    [],
                    finish_reason=ErrorCode.ENGINE_ERROR,
                    error=f"vLLM ended the request ({reason}, stop reason {output.stop_reason})",
                )
            )
        return True

    def _record_prompt_logprobs(self, sequence: Sequence, tensors: Any) -> None:
        """vLLM's prompt log-probs (a chunk of prompt positions per prefill chunk): rows of
        the prompt's token and its alternatives. A resumed request's prompt includes its
        resume tokens, whose rows are not the prompt's and are dropped."""
        token_ids = tensors.logprob_token_ids.tolist()
        logprobs = tensors.logprobs.tolist()
        wanted = sequence.prompt_len - 1 - len(sequence.prompt_logprobs)
        for ids, values in list(zip(token_ids, logprobs, strict=True))[: max(wanted, 0)]:
            sequence.prompt_logprobs.append(float(values[0]))
            if sequence.params.top_logprobs:
                sequence.prompt_top_logprobs.append(
                    list(zip(ids[1:], map(float, values[1:]), strict=True))
                )

    # ------------------------------------------------------------------------ LoRA adapters

    def load_adapter(self, name: str, path: str) -> None:
        """Register adapter ``name`` from directory ``path`` and load it in vLLM, which checks
        it (``AdapterError`` with vLLM's reason). One registered under that name already is
        replaced, unless requests still run on it."""
        if self._lora is None:
            raise AdapterError(NO_ADAPTERS)
        directory = Path(path)
        if not (directory / "adapter_config.json").is_file():
            raise AdapterError(f"adapter {name!r}: {path} has no adapter_config.json")
        previous = self._adapters.get(name)
        if previous is not None:
            self._refuse_while_in_use(name, "replaced")
        from vllm.lora.request import LoRARequest

        adapter = LoRARequest(name, next(self._adapter_ids), str(directory))
        try:
            self._client.add_lora(adapter)
        except Exception as exc:  # vLLM's loader raises what its checks find (ValueError, ...)
            raise AdapterError(f"adapter {name!r}: vLLM could not load {path}: {exc}") from None
        if previous is not None:
            self._client.remove_lora(previous.lora_int_id)
        self._adapters[name] = adapter
        # vLLM keys cached blocks by the adapter's name, not its weights: blocks cached under
        # a name served before hold what other weights computed, and no request may find them.
        if name in self._adapter_names_served and self._translator is not None:
            self._core.reset_prefix_cache()
        self._adapter_names_served.add(name)

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name`` (``KeyError`` if unknown, ``AdapterError`` while in use)."""
        if self._lora is None or name not in self._adapters:
            raise KeyError(name)
        self._refuse_while_in_use(name, "unloaded")
        self._client.remove_lora(self._adapters.pop(name).lora_int_id)

    def adapter_report(self) -> AdapterReport | None:
        if self._lora is None:
            return None
        running_ids = {request.request_id for request in self._core.scheduler.running}
        running: Counter[str] = Counter()
        waiting: Counter[str] = Counter()
        for request_id, sequence in self._live.items():
            name = sequence.params.lora_name
            if name is not None:
                vllm_id = self._vllm_ids[request_id]
                (running if vllm_id in running_ids else waiting)[name] += 1
        loaded = self._client.list_loras()
        return AdapterReport(
            int(self._lora.max_loras),
            {
                name: (adapter.lora_int_id in loaded, running[name], waiting[name])
                for name, adapter in sorted(self._adapters.items())
            },
        )

    def _check_adapter(self, name: str) -> None:
        if self._lora is None:
            raise RequestRejected(ErrorCode.BAD_REQUEST, NO_ADAPTERS)
        if name not in self._adapters:
            raise RequestRejected(ErrorCode.BAD_REQUEST, unknown_adapter(name, self._adapters))

    def _refuse_while_in_use(self, name: str, what: str) -> None:
        users = sum(1 for s in self._live.values() if s.params.lora_name == name)
        if users:
            raise AdapterError(
                f"adapter {name!r} cannot be {what} while {users} request(s) run on it"
            )

    # ------------------------------------------------------------------------------ stats

    def _note_stats(self, stats: Any) -> None:
        prefix = stats.prefix_cache_stats
        if prefix is not None:
            self._prefix_queries += int(prefix.queries)
            self._prefix_hits += int(prefix.hits)

    def stats(self) -> Mapping[str, object]:
        scheduler = self._core.scheduler
        pool = scheduler.kv_cache_manager.block_pool
        numbers: dict[str, object] = {
            "backend_vllm": 1,
            "tensor_parallel_size": self._config.parallel_config.tensor_parallel_size,
            "waiting": len(scheduler.waiting),
            "running": len(scheduler.running),
            "kv_blocks": pool.num_gpu_blocks,
            "kv_free_blocks": pool.get_num_free_blocks(),
            "kv_cache_usage": float(scheduler.kv_cache_manager.usage),
            "block_size": self._block_size,
            "prefix_caching": int(self._translator is not None),
            "prefix_cache_queries": self._prefix_queries,
            "prefix_cache_hits": self._prefix_hits,
            "tokens_generated": self._tokens_generated,
            "steps": self._steps,
            "released": self._released,
        }
        if self._translator is not None:
            numbers["kv_cached_blocks"] = len(self._translator.snapshot())
            numbers["kv_empty_blocks"] = _empty_blocks(pool)
        return numbers

    # ------------------------------------------------------------------------ prefix cache

    @property
    def kv_block_size(self) -> int | None:
        return self._block_size if self._translator is not None else None

    def kv_events(self) -> list[KVEvent]:
        if self._translator is None or self._collected is None:
            return []
        return self._translator.translate(self._collected.take())

    def kv_snapshot(self) -> list[BlockHash]:
        if self._translator is None or self._collected is None:
            return []
        self._translator.translate(self._collected.take())  # what the snapshot supersedes
        return self._translator.snapshot()

    # ------------------------------------------------------------------- suspend / resume

    def release(self) -> None:
        """Suspend: with vLLM's sleep mode (CUDA builds, ``--vllm-arg=--enable-sleep-mode``)
        the weights are offloaded and the KV cache discarded, the requests kept and recomputed
        after ``reload``; without it (vLLM's CPU build has none) the engine only stops
        stepping and keeps its memory."""
        if self._released:
            return
        self._released = True
        if self._sleep_mode:
            self._core.sleep(level=1, mode="keep")
        else:
            log.warning(
                "suspend: vLLM's sleep mode is off (the CPU build has none; on CUDA start the "
                "engine with --vllm-arg=--enable-sleep-mode): the engine pauses but keeps its "
                "memory"
            )

    def reload(self) -> None:
        if not self._released:
            return
        if self._sleep_mode:
            self._core.wake_up()
        self._released = False

    def shutdown(self) -> None:
        """Stop vLLM's engine core and its model workers (processes of their own, which would
        otherwise notice their engine is gone only seconds after it left)."""
        self._compiler.close()
        self._client.shutdown()


def _logprob_rows(logprobs: Any, count: int) -> list[tuple[float, list[TopEntry]]] | None:
    """Per new token its log-prob and alternatives, from vLLM's ``LogprobsLists`` (a row per
    token: the sampled token first, then the top alternatives)."""
    if logprobs is None or count == 0:
        return None
    token_ids = logprobs.logprob_token_ids.tolist()
    values = logprobs.logprobs.tolist()
    rows: list[tuple[float, list[TopEntry]]] = []
    for ids, row in zip(token_ids[:count], values[:count], strict=True):
        top = [(int(token), float(value)) for token, value in zip(ids[1:], row[1:], strict=True)]
        rows.append((float(row[0]), top))
    return rows


def _compile_nothing_without_a_cpp_compiler() -> None:
    """On CPU, torch's inductor compiles to C++, and vLLM's sampler compiles functions with it
    on first use (the log-prob ranking; ``VllmRunner.warm_up`` runs it at start). Where no C++
    compiler is found (dpserve's runtime images have none) that compile raised in vLLM's
    worker and ended the engine: before the warm-up, on the first request asking for log-probs.
    There, torch.compile is turned off for vLLM's workers (they inherit the variable; the
    functions run eagerly, with the same results), and the log says so. vLLM's model itself
    compiles only without ``--enforce-eager``, which needs the compiler anyway."""
    from vllm.platforms import current_platform

    compiler = os.environ.get("CXX") or "g++"
    if not current_platform.is_cpu() or shutil.which(compiler) is not None:
        return
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    import torch._dynamo

    torch._dynamo.config.disable = True  # this process's own, if it compiles anything
    log.warning(
        "no C++ compiler (%s) for torch's inductor on CPU: torch.compile is off in vLLM's "
        "workers (its sampler's helpers run eagerly; its model needs --enforce-eager)",
        compiler,
    )


def _eos_token_ids(tokenizer: Any, model: str) -> frozenset[int]:
    """The tokens that end a request by default: the model's generation config's EOS ids and
    the tokenizer's (as dpserve's engine takes them)."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        configured = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json
        configured = None
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _empty_blocks(pool: Any) -> int:
    """Free blocks of vLLM's pool that hold no cached content: what it can allocate without
    evicting (the prefix-aware router's room on this engine). vLLM keeps cached blocks in its
    free queue until it reuses them, so its free count alone overstates that room. One pass
    over the pool's blocks once a heartbeat: about 1 ms for 10,000 blocks (10 ms for 100,000)."""
    cached_free = sum(
        1 for block in pool.blocks if not block.ref_cnt and block.block_hash is not None
    )
    return max(0, int(pool.get_num_free_blocks()) - cached_free)
