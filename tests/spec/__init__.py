"""The spec language: parsing, validation, shape inference and the memory guard."""
