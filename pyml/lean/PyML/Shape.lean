/-
Shapes: a typed layer-composition structure. A `Layer i o` maps width `i` to width `o`, and a
`Chain i k` strings layers together, so a model skeleton type-checks only where every junction's
dims agree. The backward pass of a chain is the reversed chain of transposed layers, it is the
adjoint of the forward pass, and each parameter gradient has the type of its parameter.
-/
import PyML.Laws

namespace PyML

/-- One layer from width `i` to width `o`, holding its parameter. -/
inductive Layer : Nat → Nat → Type where
  /-- `v ↦ W v` with `W : Mat o i`. -/
  | linear {i o : Nat} (W : Mat o i) : Layer i o
  /-- `v ↦ w ⊙ v`: an element-wise gain (the RMSNorm weight), width preserved. -/
  | scale {n : Nat} (w : Vec n) : Layer n n

/-- A chain of layers from width `i` to width `k`. -/
inductive Chain : Nat → Nat → Type where
  /-- The empty chain. -/
  | nil {n : Nat} : Chain n n
  /-- A layer `i → j`, then a chain `j → k`. -/
  | layer {i j k : Nat} (L : Layer i j) (rest : Chain j k) : Chain i k
  /-- A residual block `v ↦ v + body v` of width `n`, then a chain `n → k`. -/
  | residual {n k : Nat} (body : Chain n n) (rest : Chain n k) : Chain n k

/-! ## Layers -/

/-- A layer's forward map. -/
def Layer.forward : {i o : Nat} → Layer i o → Vec i → Vec o
  | _, _, .linear W, v => matVec W v
  | _, _, .scale w, v => hadamard w v

/-- A layer's backward map on the input side (the adjoint of its forward map). -/
def Layer.backward : {i o : Nat} → Layer i o → Vec o → Vec i
  | _, _, .linear W, g => matTVec W g
  | _, _, .scale w, g => hadamard w g

/-- The transposed layer, from width `o` back to width `i`. -/
def Layer.transposed : {i o : Nat} → Layer i o → Layer o i
  | _, _, .linear W => .linear (transpose W)
  | _, _, .scale w => .scale w

/-- The type of a layer's parameter. -/
def Layer.Param : {i o : Nat} → Layer i o → Type
  | _, _, @Layer.linear i o _ => Mat o i
  | _, _, @Layer.scale n _ => Vec n

/-- The same layer with its parameter replaced by `P`. -/
def Layer.withParam : {i o : Nat} → (L : Layer i o) → L.Param → Layer i o
  | _, _, .linear _, P => .linear P
  | _, _, .scale _, P => .scale P

/-- The inner product on a layer's parameter space. -/
def Layer.pairing : {i o : Nat} → (L : Layer i o) → L.Param → L.Param → Int
  | _, _, .linear _, A, B => frob A B
  | _, _, .scale _, a, b => dot a b

/-- The gradient of a layer's parameter for input `v` and output gradient `g`; by its type it
has the shape of the parameter. -/
def Layer.paramGrad : {i o : Nat} → (L : Layer i o) → Vec i → Vec o → L.Param
  | _, _, .linear _, v, g => outer g v
  | _, _, .scale _, v, g => hadamard g v

/-- A placeholder linear layer from width `i` to width `o`, for skeletons where only dims matter. -/
def Layer.dense (i o : Nat) : Layer i o := .linear (fun _ _ => 0)

/-- A placeholder element-wise gain of width `n`. -/
def Layer.gain (n : Nat) : Layer n n := .scale (fun _ => 0)

/-- Each layer's backward map is the adjoint of its forward map. -/
theorem Layer.adjoint : {i o : Nat} → (L : Layer i o) → IsAdjoint L.forward L.backward
  | _, _, .linear W => by
    intro g v
    exact linear_input_adjoint W g v
  | _, _, .scale w => by
    intro g v
    exact scale_adjoint w g v

/-- The transposed layer's forward map is the layer's backward map. -/
theorem Layer.transposed_forward : {i o : Nat} → (L : Layer i o) → (g : Vec o) →
    L.transposed.forward g = L.backward g
  | _, _, .linear _, _ => rfl
  | _, _, .scale _, _ => rfl

/-! ## Chains -/

/-- A chain's forward map: the layers in order, a residual block adding its body to its input. -/
def Chain.forward : {i k : Nat} → Chain i k → Vec i → Vec k
  | _, _, .nil, v => v
  | _, _, .layer L rest, v => Chain.forward rest (L.forward v)
  | _, _, .residual body rest, v => Chain.forward rest (vecAdd v (Chain.forward body v))

/-- A chain's backward map: the layers' backward maps in reverse order; a residual block adds
the gradient passed back through its body to the gradient that skips it. -/
def Chain.backward : {i k : Nat} → Chain i k → Vec k → Vec i
  | _, _, .nil, g => g
  | _, _, .layer L rest, g => L.backward (Chain.backward rest g)
  | _, _, .residual body rest, g =>
    vecAdd (Chain.backward rest g) (Chain.backward body (Chain.backward rest g))

/-- Composition of chains: `C` then `D`; it type-checks only when `C` ends where `D` starts. -/
def Chain.append : {i j k : Nat} → Chain i j → Chain j k → Chain i k
  | _, _, _, .nil, D => D
  | _, _, _, .layer L rest, D => .layer L (Chain.append rest D)
  | _, _, _, .residual body rest, D => .residual body (Chain.append rest D)

/-- The backward chain, from width `k` back to width `i`: the transposed layers in reverse order. -/
def Chain.transposed : {i k : Nat} → Chain i k → Chain k i
  | _, _, .nil => .nil
  | _, _, .layer L rest => Chain.append (Chain.transposed rest) (.layer L.transposed .nil)
  | _, _, .residual body rest =>
    Chain.append (Chain.transposed rest) (.residual (Chain.transposed body) .nil)

/-- law: chain composition: the forward map of `C` then `D` is `D`'s forward map after `C`'s. -/
theorem chain_append_forward : {i j k : Nat} → (C : Chain i j) → (D : Chain j k) → (v : Vec i) →
    (C.append D).forward v = D.forward (C.forward v)
  | _, _, _, .nil, _, _ => rfl
  -- both sides unfold to the claim for the rest of the chain, on the rest's input
  | _, _, _, .layer L rest, D, v => chain_append_forward rest D (L.forward v)
  | _, _, _, .residual body rest, D, v =>
    chain_append_forward rest D (vecAdd v (body.forward v))

/-- law: chain backward: the backward map of every chain is the adjoint of its forward map. -/
theorem chain_adjoint : {i k : Nat} → (C : Chain i k) → IsAdjoint C.forward C.backward
  | _, _, .nil => by
    intro g v
    rfl
  | _, _, .layer L rest => by
    -- a layer followed by the rest: the composition law
    have h := compose_adjoint (chain_adjoint rest) (Layer.adjoint L)
    exact h
  | _, _, .residual body rest => by
    -- a residual block followed by the rest: the residual law, then the composition law
    have h := compose_adjoint (chain_adjoint rest) (residual_adjoint (chain_adjoint body))
    exact h

/-- law: reversed chain: the forward map of the transposed chain is the chain's backward map. -/
theorem chain_transposed_forward : {i k : Nat} → (C : Chain i k) → (g : Vec k) →
    C.transposed.forward g = C.backward g
  | _, _, .nil, _ => rfl
  | _, _, .layer L rest, g =>
    -- run the transposed rest first (the claim for the rest), then the transposed layer
    calc (Chain.layer L rest).transposed.forward g
        = (Chain.layer L.transposed .nil).forward (rest.transposed.forward g) :=
          chain_append_forward rest.transposed (.layer L.transposed .nil) g
      _ = (Chain.layer L.transposed .nil).forward (rest.backward g) :=
          congrArg (Chain.forward (.layer L.transposed .nil)) (chain_transposed_forward rest g)
      _ = (Chain.layer L rest).backward g := Layer.transposed_forward L (rest.backward g)
  | _, _, .residual body rest, g =>
    -- run the transposed rest first, then the residual block of the transposed body
    calc (Chain.residual body rest).transposed.forward g
        = (Chain.residual body.transposed .nil).forward (rest.transposed.forward g) :=
          chain_append_forward rest.transposed (.residual body.transposed .nil) g
      _ = (Chain.residual body.transposed .nil).forward (rest.backward g) :=
          congrArg (Chain.forward (.residual body.transposed .nil)) (chain_transposed_forward rest g)
      _ = vecAdd (rest.backward g) (body.transposed.forward (rest.backward g)) := rfl
      _ = vecAdd (rest.backward g) (body.backward (rest.backward g)) :=
          congrArg (vecAdd (rest.backward g)) (chain_transposed_forward body (rest.backward g))
      _ = (Chain.residual body rest).backward g := rfl

/-- law: parameter gradient: for every layer `L` and parameter `P`, `⟨g, (L with P) v⟩ = ⟨paramGrad L v g, P⟩`: the gradient has the parameter's type and is the adjoint of the parameter-to-output map. -/
theorem layer_param_grad_adjoint : {i o : Nat} → (L : Layer i o) → (P : L.Param) → (v : Vec i) →
    (g : Vec o) → dot g ((L.withParam P).forward v) = L.pairing (L.paramGrad v g) P
  | _, _, @Layer.linear i o _, P, v, g => linear_param_adjoint (m := o) (n := i) P g v
  | _, _, @Layer.scale n _, P, v, g => hadamard_adjoint (n := n) g P v

end PyML
