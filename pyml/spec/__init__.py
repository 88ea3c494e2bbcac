"""The typed layer spec: Pydantic models of layers and models, shape inference and checking."""

from pyml.spec.load import load_spec, parse_spec
from pyml.spec.models import DecoderModel, SequentialModel

__all__ = ["DecoderModel", "SequentialModel", "load_spec", "parse_spec"]
