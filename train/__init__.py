"""Training and checkpoint studies: the task and language-model trainers on one shared run loop (train.run),
evaluation, and the key/query pruning study. Uses models, tasks and store.cliparse's one-line parser;
nothing below imports it."""
