"""`pyml train`: the loop, checkpoints, data, LoRA, data-parallel training on MPI, the fine-tuning
loop of the real models."""
