"""Training a generated package: `run.train` builds a run from `pyml train`'s options (config,
data, model), `loop.run_training` runs it (checkpoints, resume, Ctrl-C, evaluation, the loss
curve), LoRA adapters, and data-parallel training on MPI ranks (distributed, gradient_exchange)."""
