"""``Intake``: the submit half of the batch step — admit, tokenize (one call per drained
batch), check the prompt's length, route and send."""

from __future__ import annotations

import time

from dpserve import protocol
from dpserve.coordinator.admission import Admission, chat_messages, is_chat, token_prompt
from dpserve.coordinator.control import ControlRelay
from dpserve.coordinator.dispatch import Dispatcher
from dpserve.coordinator.requests import InflightRequest
from dpserve.coordinator.shared import SharedState
from dpserve.protocol import Cancel, ErrorCode, ProtocolError, SubmitRequest, SubmitRequests
from dpserve.sampling import InvalidSamplingParams
from dpserve.tokenizer import released_texts


class Intake:
    def __init__(
        self,
        shared: SharedState,
        admission: Admission,
        dispatcher: Dispatcher,
        control: ControlRelay,
    ) -> None:
        self.shared = shared
        self.admission = admission
        self.dispatcher = dispatcher
        self.control = control
        # This batch's accepted requests, and those of them whose text is still to tokenize.
        self._accepted: list[InflightRequest] = []
        self._texts: list[tuple[InflightRequest, str]] = []

    def on_submit(self, identity: bytes, submit: SubmitRequest) -> None:
        client_request_id, prompt, raw_params, resume_tokens = submit
        shared = self.shared
        client = shared.clients.get(identity)
        if client is None:
            shared.transport.error(
                identity, client_request_id, ErrorCode.UNKNOWN_PEER, "connect before submitting"
            )
            return
        if shared.requests.find(identity, client_request_id) is not None:
            return  # a resubmission (client reconnected) of a request we are already serving
        refusal = self.admission.refusal(client, len(shared.requests), self.control.state, prompt)
        if refusal is not None:
            shared.transport.error(identity, client_request_id, *refusal)
            return
        try:
            params = self.admission.validated_params(raw_params)
            if is_chat(prompt):
                prompt = shared.tokenizer.apply_chat_template(chat_messages(prompt))
            prompt_tokens = b"" if isinstance(prompt, str) else token_prompt(prompt)
            if len(resume_tokens) % 4:
                raise ProtocolError("resume tokens must be packed int32 tokens")
        except (InvalidSamplingParams, ProtocolError) as exc:
            shared.transport.error(identity, client_request_id, ErrorCode.BAD_REQUEST, str(exc))
            return
        request = InflightRequest(
            request_id=shared.requests.new_id(),
            client=identity,
            client_request_id=client_request_id,
            prompt_tokens=prompt_tokens,
            params=params,
            stream=bool(params.get("stream")),
            received_at=time.monotonic(),
            # The tokens a resubmitting client already has: engines continue after them.
            generated=bytearray(resume_tokens),
        )
        shared.requests.add(request)
        client.inflight += 1
        if isinstance(prompt, str):
            self._texts.append((request, prompt))  # tokenized with the rest of the batch
        self._accepted.append(request)

    def _start_with_the_text_the_client_has(self, accepted: list[InflightRequest]) -> None:
        """A resumed request's text begins with its resume tokens' text (the client has it: the
        engine streams only what follows, as ``IncrementalDetokenizer`` holds it back)."""
        resumed = [request for request in accepted if request.generated]
        if not resumed:
            return
        texts = released_texts(
            self.shared.tokenizer, [protocol.unpack_tokens(r.generated) for r in resumed]
        )
        for request, text in zip(resumed, texts, strict=True):
            request.text.append(text)

    def _tokenize_texts(self) -> None:
        """One tokenizer call for the batch. Should it raise, each prompt is tokenized alone, so
        that only a prompt the tokenizer cannot take fails (``bad_request``) and the others of
        the batch go on."""
        texts, self._texts = self._texts, []
        try:
            batch: list[list[int]] | None = self.shared.tokenizer.encode_batch(
                [t for _, t in texts]
            )
        except Exception:
            batch = None
        for index, (request, text) in enumerate(texts):
            try:
                tokens = batch[index] if batch else self.shared.tokenizer.encode_batch([text])[0]
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"[:500]
                self.dispatcher.fail(
                    request, ErrorCode.BAD_REQUEST, f"the tokenizer cannot encode the prompt: {why}"
                )
                continue
            request.prompt_tokens = protocol.pack_tokens(tokens)

    def on_submits(self, identity: bytes, batch: SubmitRequests) -> None:
        """SUBMIT_REQUESTS: each request as its own SUBMIT_REQUEST, in order."""
        for submit in batch.requests:
            self.on_submit(identity, submit)

    def on_cancel(self, identity: bytes, cancel: Cancel) -> None:
        request = self.shared.requests.find(identity, cancel.ref)
        if request is not None:
            self.dispatcher.cancel(request)

    def flush(self) -> None:
        """Tokenize this batch's text prompts in one call, then check and send each request."""
        if not self._accepted:
            return
        if self._texts:
            self._tokenize_texts()
        by_id = self.shared.requests.by_id
        accepted = [request for request in self._accepted if request.request_id in by_id]
        self._accepted.clear()
        self._start_with_the_text_the_client_has(accepted)
        for request in accepted:
            refusal = self.admission.prompt_tokens_refusal(request.prompt_tokens)
            if refusal is not None:
                self.dispatcher.fail(request, *refusal)
            elif request.request_id in self.shared.requests.by_id:
                self.dispatcher.dispatch(request)
