"""The building blocks of a model's forward (linear, norm, rotary, MLP, attention, the cache
tensors); ``kernel_choice`` decides once which implementation each runs on a device."""
