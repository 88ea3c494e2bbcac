"""Generation: decoding with a KV cache, on float32 and quantized weights, sampling, `pyml
generate`."""
