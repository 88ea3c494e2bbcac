/-
The laws the generated backward passes rest on, for all dims and all values of the exact model.
Every law is a theorem preceded by a doc comment that begins with `law:`; `pyml/laws.py` reads
the index of laws (name and statement) from these comments, and `PyML/Axioms.lean` prints the
axioms each law depends on.
-/
import PyML.Model

namespace PyML

/-- law: linear layer, input side: `⟨g, W v⟩ = ⟨Wᵀ g, v⟩`, so dv = Wᵀ g. -/
theorem linear_input_adjoint {m n : Nat} (W : Mat m n) (g : Vec m) (v : Vec n) :
    dot g (matVec W v) = dot (matTVec W g) v :=
  -- push g i into the row sum, swap the two sums, pull v j out of the column sum
  calc dot g (matVec W v)
      = sum m (fun i => g i * sum n (fun j => W i j * v j)) := rfl
    _ = sum m (fun i => sum n (fun j => g i * (W i j * v j))) :=
        sum_congr m (fun i => (sum_mul_left n (g i) (fun j => W i j * v j)).symm)
    _ = sum n (fun j => sum m (fun i => g i * (W i j * v j))) :=
        sum_comm m n (fun i j => g i * (W i j * v j))
    _ = sum n (fun j => sum m (fun i => W i j * g i) * v j) :=
        sum_congr n (fun j =>
          (sum_congr m (fun i => mul_swap_left (g i) (W i j) (v j))).trans
            (sum_mul_right m (v j) (fun i => W i j * g i)))
    _ = dot (matTVec W g) v := rfl

/-- law: matrix product, left argument: `⟨G, A B⟩ = ⟨G Bᵀ, A⟩`, so dA = G Bᵀ. -/
theorem matmul_adjoint_left {m k n : Nat} (G : Mat m n) (A : Mat m k) (B : Mat k n) :
    frob G (matMul A B) = frob (matMul G (transpose B)) A :=
  -- per row i: swap the sums over the column j and the inner index l, then pull A i l out
  calc frob G (matMul A B)
      = sum m (fun i => sum n (fun j => sum k (fun l => G i j * (A i l * B l j)))) :=
        frob_matMul_expand G A B
    _ = sum m (fun i => sum k (fun l => sum n (fun j => G i j * (A i l * B l j)))) :=
        sum_congr m (fun i => sum_comm n k (fun j l => G i j * (A i l * B l j)))
    _ = sum m (fun i => sum k (fun l => sum n (fun j => G i j * B l j) * A i l)) :=
        sum_congr m (fun i => sum_congr k (fun l =>
          (sum_congr n (fun j => mul_swap_right (G i j) (A i l) (B l j))).trans
            (sum_mul_right n (A i l) (fun j => G i j * B l j))))
    _ = frob (matMul G (transpose B)) A := rfl

/-- law: matrix product, right argument: `⟨G, A B⟩ = ⟨Aᵀ G, B⟩`, so dB = Aᵀ G. -/
theorem matmul_adjoint_right {m k n : Nat} (G : Mat m n) (A : Mat m k) (B : Mat k n) :
    frob G (matMul A B) = frob (matMul (transpose A) G) B :=
  -- bring the sum over rows i innermost (three swaps), then pull B l j out of it
  calc frob G (matMul A B)
      = sum m (fun i => sum n (fun j => sum k (fun l => G i j * (A i l * B l j)))) :=
        frob_matMul_expand G A B
    _ = sum m (fun i => sum k (fun l => sum n (fun j => G i j * (A i l * B l j)))) :=
        sum_congr m (fun i => sum_comm n k (fun j l => G i j * (A i l * B l j)))
    _ = sum k (fun l => sum m (fun i => sum n (fun j => G i j * (A i l * B l j)))) :=
        sum_comm m k (fun i l => sum n (fun j => G i j * (A i l * B l j)))
    _ = sum k (fun l => sum n (fun j => sum m (fun i => G i j * (A i l * B l j)))) :=
        sum_congr k (fun l => sum_comm m n (fun i j => G i j * (A i l * B l j)))
    _ = sum k (fun l => sum n (fun j => sum m (fun i => A i l * G i j) * B l j)) :=
        sum_congr k (fun l => sum_congr n (fun j =>
          (sum_congr m (fun i => mul_swap_left (G i j) (A i l) (B l j))).trans
            (sum_mul_right m (B l j) (fun i => A i l * G i j))))
    _ = frob (matMul (transpose A) G) B := rfl

/-- law: linear layer over a batch, input side: for `Y = X Wᵀ`, `⟨G, X Wᵀ⟩ = ⟨G W, X⟩`, so dX = G W. -/
theorem linear_weight_adjoint_input {T m k : Nat} (G : Mat T m) (X : Mat T k) (W : Mat m k) :
    frob G (matMul X (transpose W)) = frob (matMul G W) X :=
  -- the left-argument matmul law with B = Wᵀ, since (Wᵀ)ᵀ is W by definition
  matmul_adjoint_left G X (transpose W)

/-- law: linear layer over a batch, weight side: for `Y = X Wᵀ`, `⟨G, X Wᵀ⟩ = ⟨Gᵀ X, W⟩`, so dW = Gᵀ X. -/
theorem linear_weight_adjoint_weight {T m k : Nat} (G : Mat T m) (X : Mat T k) (W : Mat m k) :
    frob G (matMul X (transpose W)) = frob (matMul (transpose G) X) W :=
  -- bring the sum over tokens t innermost (two swaps), then pull W o l out of it
  calc frob G (matMul X (transpose W))
      = sum T (fun t => sum m (fun o => sum k (fun l => G t o * (X t l * W o l)))) :=
        frob_matMul_expand G X (transpose W)
    _ = sum m (fun o => sum T (fun t => sum k (fun l => G t o * (X t l * W o l)))) :=
        sum_comm T m (fun t o => sum k (fun l => G t o * (X t l * W o l)))
    _ = sum m (fun o => sum k (fun l => sum T (fun t => G t o * (X t l * W o l)))) :=
        sum_congr m (fun o => sum_comm T k (fun t l => G t o * (X t l * W o l)))
    _ = sum m (fun o => sum k (fun l => sum T (fun t => G t o * X t l) * W o l)) :=
        sum_congr m (fun o => sum_congr k (fun l =>
          (sum_congr T (fun t => (Int.mul_assoc (G t o) (X t l) (W o l)).symm)).trans
            (sum_mul_right T (W o l) (fun t => G t o * X t l))))
    _ = frob (matMul (transpose G) X) W := rfl

/-- law: embedding: `⟨G, gather E ids⟩ = ⟨scatterAdd G ids, E⟩`, so dE = the scatter-add of G by ids. -/
theorem embedding_adjoint {V D T : Nat} (G : Mat T D) (E : Mat V D) (ids : Fin T → Fin V) :
    frob G (gather E ids) = frob (scatterAdd G ids) E :=
  -- write E (ids t) j as an indicator sum over table rows r, move that sum outermost,
  -- then pull E r j out of the sum over tokens
  calc frob G (gather E ids)
      = sum T (fun t => sum D (fun j => G t j * E (ids t) j)) := rfl
    _ = sum T (fun t => sum D (fun j =>
          sum V (fun r => if ids t = r then G t j * E r j else 0))) :=
        sum_congr T (fun t => sum_congr D (fun j =>
          (sum_ite_eq V (ids t) (fun r => G t j * E r j)).symm))
    _ = sum T (fun t => sum V (fun r =>
          sum D (fun j => if ids t = r then G t j * E r j else 0))) :=
        sum_congr T (fun t => sum_comm D V (fun j r => if ids t = r then G t j * E r j else 0))
    _ = sum V (fun r => sum T (fun t =>
          sum D (fun j => if ids t = r then G t j * E r j else 0))) :=
        sum_comm T V (fun t r => sum D (fun j => if ids t = r then G t j * E r j else 0))
    _ = sum V (fun r => sum D (fun j =>
          sum T (fun t => if ids t = r then G t j * E r j else 0))) :=
        sum_congr V (fun r => sum_comm T D (fun t j => if ids t = r then G t j * E r j else 0))
    _ = sum V (fun r => sum D (fun j =>
          sum T (fun t => if ids t = r then G t j else 0) * E r j)) :=
        sum_congr V (fun r => sum_congr D (fun j =>
          (sum_congr T (fun t => ite_mul_zero (ids t = r) (G t j) (E r j))).trans
            (sum_mul_right T (E r j) (fun t => if ids t = r then G t j else 0))))
    _ = frob (scatterAdd G ids) E := rfl

/-- law: element-wise product (the SwiGLU gate): `⟨g, a ⊙ b⟩ = ⟨g ⊙ b, a⟩`, so da = g ⊙ b. -/
theorem hadamard_adjoint {n : Nat} (g a b : Vec n) :
    dot g (hadamard a b) = dot (hadamard g b) a :=
  -- each term regroups: g i * (a i * b i) = g i * b i * a i
  calc dot g (hadamard a b)
      = sum n (fun i => g i * (a i * b i)) := rfl
    _ = sum n (fun i => g i * b i * a i) :=
        sum_congr n (fun i => mul_swap_right (g i) (a i) (b i))
    _ = dot (hadamard g b) a := rfl

/-- law: constant scale (the embedding scale, the attention's score scale): `⟨g, c v⟩ = ⟨c g, v⟩`, so dv = c g. -/
theorem smul_adjoint {n : Nat} (c : Int) (g v : Vec n) : dot g (smul c v) = dot (smul c g) v :=
  -- each term regroups: g i * (c * v i) = c * g i * v i
  calc dot g (smul c v)
      = sum n (fun i => g i * (c * v i)) := rfl
    _ = sum n (fun i => c * g i * v i) :=
        sum_congr n (fun i => mul_swap_left (g i) c (v i))
    _ = dot (smul c g) v := rfl

/-- law: bias over a batch: for `Y = X + 1 bᵀ`, `⟨G, 1 bᵀ⟩ = ⟨colSum G, b⟩`, so db is the column sum of G. -/
theorem bias_adjoint {T n : Nat} (G : Mat T n) (b : Vec n) :
    frob G (broadcast T b) = dot (colSum G) b :=
  -- swap the sums over rows and columns, then pull b j out of the sum over rows
  calc frob G (broadcast T b)
      = sum T (fun t => sum n (fun j => G t j * b j)) := rfl
    _ = sum n (fun j => sum T (fun t => G t j * b j)) :=
        sum_comm T n (fun t j => G t j * b j)
    _ = sum n (fun j => sum T (fun t => G t j) * b j) :=
        sum_congr n (fun j => sum_mul_right T (b j) (fun t => G t j))
    _ = dot (colSum G) b := rfl

/-- law: residual fan-out: if `fT` is the adjoint of `f`, the adjoint of `v ↦ v + f v` is `g ↦ g + fT g`. -/
theorem residual_adjoint {n : Nat} {f : Vec n → Vec n} {fT : Vec n → Vec n}
    (hf : IsAdjoint f fT) : IsAdjoint (fun v => vecAdd v (f v)) (fun g => vecAdd g (fT g)) := by
  -- the skip path passes g back unchanged, the body passes back fT g; the fan-out adds the two
  intro g v
  calc dot g (vecAdd v (f v))
      = dot g v + dot g (f v) := dot_vecAdd_right g v (f v)
    _ = dot g v + dot (fT g) v := by rw [hf g v]
    _ = dot (vecAdd g (fT g)) v := (dot_vecAdd_left g (fT g) v).symm

/-- law: composition: if `fT` is the adjoint of `f` and `hT` of `h`, the adjoint of `f ∘ h` is `hT ∘ fT`; the backward pass is the forward composition reversed. -/
theorem compose_adjoint {m k n : Nat} {f : Vec k → Vec m} {fT : Vec m → Vec k}
    {h : Vec n → Vec k} {hT : Vec k → Vec n} (hf : IsAdjoint f fT) (hh : IsAdjoint h hT) :
    IsAdjoint (fun v => f (h v)) (fun g => hT (fT g)) := by
  -- move g back through f, then through h
  intro g v
  exact (hf g (h v)).trans (hh (fT g) v)

/-- law: block rotation (RoPE): for any cos/sin values `c`, `s`, the adjoint of `rotate c s` is the transposed rotation `rotateT c s`. -/
theorem rotation_adjoint {n : Nat} (c s g₁ g₂ x₁ x₂ : Vec n) :
    dot g₁ (rotate c s x₁ x₂).1 + dot g₂ (rotate c s x₁ x₂).2
      = dot (rotateT c s g₁ g₂).1 x₁ + dot (rotateT c s g₁ g₂).2 x₂ :=
  -- merge the two halves into one sum, apply the 2×2 identity per index, split again
  calc dot g₁ (rotate c s x₁ x₂).1 + dot g₂ (rotate c s x₁ x₂).2
      = sum n (fun i => g₁ i * (c i * x₁ i - s i * x₂ i) + g₂ i * (s i * x₁ i + c i * x₂ i)) :=
        (sum_add n (fun i => g₁ i * (c i * x₁ i - s i * x₂ i))
          (fun i => g₂ i * (s i * x₁ i + c i * x₂ i))).symm
    _ = sum n (fun i => (c i * g₁ i + s i * g₂ i) * x₁ i + (c i * g₂ i - s i * g₁ i) * x₂ i) :=
        sum_congr n (fun i => rotate_pointwise (c i) (s i) (g₁ i) (g₂ i) (x₁ i) (x₂ i))
    _ = dot (rotateT c s g₁ g₂).1 x₁ + dot (rotateT c s g₁ g₂).2 x₂ :=
        sum_add n (fun i => (c i * g₁ i + s i * g₂ i) * x₁ i)
          (fun i => (c i * g₂ i - s i * g₁ i) * x₂ i)

end PyML
