"""LoRA adapters in the paged engine: PEFT directories loaded and checked against the model
(``adapter``), held in a fixed number of slots (``slots``), and the batched delta that one step
adds to each projection for the rows of each adapter (``delta``)."""
