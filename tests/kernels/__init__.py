"""The kernels of pyml/package against PyTorch, finite differences and gguf's quantized blocks; the
thread pools."""
