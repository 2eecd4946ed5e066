"""The vLLM engine backend: ``dpserve engine --backend vllm``.

vLLM's v1 engine core runs in the engine process as its compute side (``runner.VllmRunner``
implements ``dpserve.engine.runner.Runner``), so the engine server, the coordinator, the HTTP
front and the client are the same as with dpserve's own engine. vLLM lives in an install of its
own (``make vllm``: it pins transformers and llguidance below what dpserve's default install
resolves), so nothing outside this package imports it, and every module here imports it only
inside the functions that need it: the package itself imports without vLLM (the CLI, the
docs' module map and mypy read it in the default install).
"""
