"""The label of a position with no target; torch-free, so the store, probes and dashboard import it cheaply."""

IGNORE_INDEX = -100
"""Label of a position with no target (Hugging Face's convention): the loss and every metric skip it."""
