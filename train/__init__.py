"""Training and checkpoint studies: the task and language-model trainers, evaluation, and the
key/query pruning study. Uses models and tasks; nothing below imports it."""
