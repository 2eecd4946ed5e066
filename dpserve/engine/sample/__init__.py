"""Turning logits into tokens: the batched sampler and structured output's grammars."""
