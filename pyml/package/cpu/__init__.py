"""The CPU kernels of the op kinds whose kernels are the same for every spec: one module per kind
(`pyml/codegen/kinds/` has the kind's other half), the dims read from the arrays and the spec's
constants (eps, a scale, a gain's offset) passed as arguments. Attention and LoRA's frozen linear
map are rendered per spec instead (`pyml.codegen.kinds`: `template`); the frozen map's products,
on a float or a stored weight, are frozen_linear's.

This module's names are what every generated kernels_cpu.py re-exports (`from pyml.package.cpu
import *`), so a generated model calls each kernel as `k.name`: the kinds' kernels, the kernels
the same for every model (AdamW, the residual joins), and what the rendered kernels call.
"""

from pyml.package.cpu.attention import DECODE_GROUP_JOBS, clear_outside_window, row_start
from pyml.package.kernels_cpu import (
    adamw_grad_norm,
    adamw_scale,
    adamw_step,
    add_into,
    copy_into,
    linear_product,
    residual_add,
)
from pyml.package.cpu.activations import (
    gelu_backward,
    gelu_forward,
    relu_backward,
    relu_forward,
    silu_backward,
    silu_forward,
)
from pyml.package.cpu.embedding import (
    embedding_backward,
    embedding_forward,
    embedding_forward_kernel,
    embedding_forward_unscaled,
)
from pyml.package.cpu.frozen_linear import frozen_input_gradient, frozen_product
from pyml.package.cpu.glu import geglu_backward, geglu_forward, swiglu_backward, swiglu_forward
from pyml.package.cpu.head_rmsnorm import head_rmsnorm_backward, head_rmsnorm_forward
from pyml.package.cpu.layernorm import (
    layernorm_backward,
    layernorm_backward_add,
    layernorm_forward,
    layernorm_unbiased_backward,
    layernorm_unbiased_backward_add,
    layernorm_unbiased_forward,
)
from pyml.package.cpu.linear import (
    linear_backward,
    linear_bias_backward,
    linear_bias_forward,
    linear_forward,
)
from pyml.package.cpu.loss import loss_forward, loss_forward_backward, target_log_probs
from pyml.package.cpu.rmsnorm import (
    rmsnorm_backward,
    rmsnorm_backward_add,
    rmsnorm_forward,
    rmsnorm_forward_residual,
)
from pyml.package.cpu.rope import rope_backward, rope_decode, rope_decode_rows, rope_forward, rope_tables
from pyml.package.vector_math import (
    MAX_LANES,
    dot_float64,
    dots_4x4,
    exp_vectorizable,
    max_value,
    sum_float64,
)

__all__ = [
    "frozen_input_gradient",
    "frozen_product",
    "layernorm_backward",
    "layernorm_backward_add",
    "layernorm_forward",
    "layernorm_unbiased_backward",
    "layernorm_unbiased_backward_add",
    "layernorm_unbiased_forward",
    "DECODE_GROUP_JOBS",
    "clear_outside_window",
    "row_start",
    "adamw_grad_norm",
    "adamw_scale",
    "adamw_step",
    "add_into",
    "copy_into",
    "linear_product",
    "residual_add",
    "gelu_backward",
    "gelu_forward",
    "relu_backward",
    "relu_forward",
    "silu_backward",
    "silu_forward",
    "embedding_backward",
    "embedding_forward",
    "embedding_forward_kernel",
    "embedding_forward_unscaled",
    "geglu_backward",
    "geglu_forward",
    "swiglu_backward",
    "swiglu_forward",
    "head_rmsnorm_backward",
    "head_rmsnorm_forward",
    "linear_backward",
    "linear_bias_backward",
    "linear_bias_forward",
    "linear_forward",
    "loss_forward",
    "loss_forward_backward",
    "target_log_probs",
    "rmsnorm_backward",
    "rmsnorm_backward_add",
    "rmsnorm_forward",
    "rmsnorm_forward_residual",
    "rope_backward",
    "rope_decode",
    "rope_decode_rows",
    "rope_forward",
    "rope_tables",
    "MAX_LANES",
    "dot_float64",
    "dots_4x4",
    "exp_vectorizable",
    "max_value",
    "sum_float64",
]
