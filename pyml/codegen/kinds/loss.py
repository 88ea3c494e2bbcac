"""loss: softmax cross-entropy of the logits against the targets (targets of -100 ignored, as
torch's), averaged; one kernel writes the loss and d loss / d logits over the logits. A weighted
loss (a preference loss: `DecoderModel.loss_and_grads(token_weights=...)`) sets
`s.token_weights`, each row's weight in place of the mean's 1 / n."""

from __future__ import annotations

from pyml.codegen.calls import Act, Call, Code, Grad, Statement
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind


class Loss(Kind):
    name = "loss"

    def kernels(self, context: dict) -> dict[str, tuple[str, dict]]:
        return {"forward_backward": ("loss_forward_backward", {}), "forward": ("loss_forward", {})}

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        return []  # the loss is computed with its gradient, in the backward pass

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        env.mode(op.inputs[0])  # the logits' gradient is written here
        logits = op.inputs[0]
        call = self.call(op, env, "forward_backward", Act(logits), Code("s.targets"), Grad(logits),
                         Code("s.token_weights"))
        return [Call(call.fn, call.args, ("loss",))]


KIND = Loss()
