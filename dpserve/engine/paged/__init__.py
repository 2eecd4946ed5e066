"""The paged engine core: what turns a model into a continuous-batching backend (the backend,
the scheduler and block pool, the step's batch builder, the device queue, the CUDA graphs).
No model code: a model is anything ``models.base.PagedModel`` describes."""
