"""The error every checkpoint loader raises (fla-format and transformers alike), apart from the loaders so that
`models.checkpoint` and `models.hf.loader`, which call each other's loaders, need not import each other for it."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the problem and the fix."""
