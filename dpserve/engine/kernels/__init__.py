"""Hand-written kernels: Triton (CUDA, and Triton's interpreter in the CPU tests) and the C++
kernels of ``cpu_kernels`` (CPU, fp32), each beside a torch version in ``engine.layers``."""
