"""Files in and out: GGUF import and export, quantization, safetensors, Hugging Face configs,
tokenizers, corrupt files."""
