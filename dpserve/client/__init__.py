"""The asyncio client for the coordinator: ``InferenceClient`` (Megatron-Core's API) and what it
hands out and takes. ``inference_client`` holds the class, ``connection`` its socket and
handshake watch, ``pending`` the requests awaiting answers, ``records`` errors and results."""

from dpserve.client.inference_client import InferenceClient
from dpserve.client.records import (
    ClientError,
    ClientStopped,
    CoordinatorRefused,
    CoordinatorUnavailable,
    Prompt,
    RequestFailed,
    RequestRecord,
    RequestStream,
    StreamChunk,
    UnsendableRequest,
    coordinator_address,
)

__all__ = [
    "ClientError",
    "ClientStopped",
    "CoordinatorRefused",
    "CoordinatorUnavailable",
    "InferenceClient",
    "Prompt",
    "RequestFailed",
    "RequestRecord",
    "RequestStream",
    "StreamChunk",
    "UnsendableRequest",
    "coordinator_address",
]
