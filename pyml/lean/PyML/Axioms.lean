/-
The axioms each law depends on, printed by `lake build` (expected: at most `propext`,
`Classical.choice` and `Quot.sound`, the standard axioms of Lean's core).
-/
import PyML.Laws
import PyML.Shape

#print axioms PyML.linear_input_adjoint
#print axioms PyML.matmul_adjoint_left
#print axioms PyML.matmul_adjoint_right
#print axioms PyML.linear_weight_adjoint_input
#print axioms PyML.linear_weight_adjoint_weight
#print axioms PyML.embedding_adjoint
#print axioms PyML.hadamard_adjoint
#print axioms PyML.smul_adjoint
#print axioms PyML.bias_adjoint
#print axioms PyML.residual_adjoint
#print axioms PyML.compose_adjoint
#print axioms PyML.rotation_adjoint
#print axioms PyML.chain_append_forward
#print axioms PyML.chain_adjoint
#print axioms PyML.chain_transposed_forward
#print axioms PyML.layer_param_grad_adjoint
