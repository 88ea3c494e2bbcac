"""Running a trained model: `decoding` loads a model folder and generates text with a KV cache;
`quantized` decodes on the GGUF's quantized blocks (or requantized weights) through the package's
fused decode step."""
