"""dpserve: data-parallel LLM inference: ZMQ coordinator, engines and a Kubernetes operator."""

__version__ = "0.1.0"
