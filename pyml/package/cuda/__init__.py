"""The CUDA kernels of the op kinds whose kernels are the same for every spec, one module per kind,
as `pyml.package.cpu`: dims read from the arrays, the spec's constants passed as arguments. Each
function launches its kernels on device arrays; tested under Numba's CUDA simulator.

This module's names are what every generated kernels_cuda.py re-exports, as pyml.package.cpu's.
"""

from pyml.package.cuda.attention import row_start
from pyml.package.kernels_cuda import (
    adamw_grad_norm,
    adamw_scale,
    adamw_step,
    add_into,
    copy_into,
    matmul,
    residual_add,
)
from pyml.package.cuda.activations import (
    gelu_backward,
    gelu_forward,
    relu_backward,
    relu_forward,
    silu_backward,
    silu_forward,
)
from pyml.package.cuda.embedding import embedding_backward, embedding_forward
from pyml.package.cuda.glu import geglu_backward, geglu_forward, swiglu_backward, swiglu_forward
from pyml.package.cuda.head_rmsnorm import head_rmsnorm_backward, head_rmsnorm_forward
from pyml.package.cuda.layernorm import (
    layernorm_backward,
    layernorm_backward_add,
    layernorm_forward,
    layernorm_unbiased_backward,
    layernorm_unbiased_backward_add,
    layernorm_unbiased_forward,
)
from pyml.package.cuda.linear import (
    linear_backward,
    linear_bias_backward,
    linear_bias_forward,
    linear_forward,
)
from pyml.package.cuda.loss import loss_forward, loss_forward_backward, target_log_probs
from pyml.package.cuda.rmsnorm import (
    rmsnorm_backward,
    rmsnorm_backward_add,
    rmsnorm_forward,
    rmsnorm_forward_residual,
)
from pyml.package.cuda.rope import rope_backward, rope_decode, rope_forward

__all__ = [
    "layernorm_backward",
    "layernorm_backward_add",
    "layernorm_forward",
    "layernorm_unbiased_backward",
    "layernorm_unbiased_backward_add",
    "layernorm_unbiased_forward",
    "row_start",
    "adamw_grad_norm",
    "adamw_scale",
    "adamw_step",
    "add_into",
    "copy_into",
    "matmul",
    "residual_add",
    "gelu_backward",
    "gelu_forward",
    "relu_backward",
    "relu_forward",
    "silu_backward",
    "silu_forward",
    "embedding_backward",
    "embedding_forward",
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
    "rope_forward",
]
