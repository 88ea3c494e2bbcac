"""The generator: lowering, scheduling, the drift check, generated models against torch and
transformers, and the generator fuzzer."""
