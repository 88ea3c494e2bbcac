/-
The exact model: integer vectors and matrices with their dims in the types, and the operations
the layers are built from. Each definition has a one-line mirror in `pyml/exact.py`.
-/
import PyML.Sum

namespace PyML

/-- A vector of `n` integers. -/
abbrev Vec (n : Nat) := Fin n → Int

/-- An `m × n` integer matrix (`m` rows, `n` columns). -/
abbrev Mat (m n : Nat) := Fin m → Fin n → Int

/-- Dot product `⟨a, b⟩`. -/
def dot {n : Nat} (a b : Vec n) : Int := sum n (fun i => a i * b i)

/-- Matrix-vector product `W v`. -/
def matVec {m n : Nat} (W : Mat m n) (v : Vec n) : Vec m := fun i => sum n (fun j => W i j * v j)

/-- Transposed matrix-vector product `Wᵀ g`. -/
def matTVec {m n : Nat} (W : Mat m n) (g : Vec m) : Vec n := fun j => sum m (fun i => W i j * g i)

/-- Transpose `Aᵀ`. -/
def transpose {m n : Nat} (A : Mat m n) : Mat n m := fun j i => A i j

/-- Matrix product `A B`. -/
def matMul {m k n : Nat} (A : Mat m k) (B : Mat k n) : Mat m n :=
  fun i j => sum k (fun l => A i l * B l j)

/-- Frobenius inner product `⟨A, B⟩ = Σ i j, A i j * B i j`. -/
def frob {m n : Nat} (A B : Mat m n) : Int := sum m (fun i => sum n (fun j => A i j * B i j))

/-- Outer product `g vᵀ`. -/
def outer {m n : Nat} (g : Vec m) (v : Vec n) : Mat m n := fun i j => g i * v j

/-- Embedding gather: row `ids t` of the table `E` for each token `t`. -/
def gather {V D T : Nat} (E : Mat V D) (ids : Fin T → Fin V) : Mat T D := fun t j => E (ids t) j

/-- Embedding scatter-add: row `r` sums the rows of `G` of the tokens whose id is `r`. -/
def scatterAdd {V D T : Nat} (G : Mat T D) (ids : Fin T → Fin V) : Mat V D :=
  fun r j => sum T (fun t => if ids t = r then G t j else 0)

/-- Element-wise product `a ⊙ b`. -/
def hadamard {n : Nat} (a b : Vec n) : Vec n := fun i => a i * b i

/-- Scalar multiple `c v` (a constant scale: the embedding's, the attention scores'). -/
def smul {n : Nat} (c : Int) (v : Vec n) : Vec n := fun i => c * v i

/-- The `T × n` matrix whose every row is `b` (a bias added to each of `T` rows). -/
def broadcast {n : Nat} (T : Nat) (b : Vec n) : Mat T n := fun _ j => b j

/-- Column sums of `G`: `Σ t, G t j`. -/
def colSum {T n : Nat} (G : Mat T n) : Vec n := fun j => sum T (fun t => G t j)

/-- Vector sum `a + b`. -/
def vecAdd {n : Nat} (a b : Vec n) : Vec n := fun i => a i + b i

/-- RoPE-style block rotation of the halves `(x₁, x₂)` by the angles whose cosines are `c` and
sines are `s` (free values): per index, the 2×2 block `[[c, -s], [s, c]]`. -/
def rotate {n : Nat} (c s x₁ x₂ : Vec n) : Vec n × Vec n :=
  (fun i => c i * x₁ i - s i * x₂ i, fun i => s i * x₁ i + c i * x₂ i)

/-- The transposed block rotation: per index, the 2×2 block `[[c, s], [-s, c]]`. -/
def rotateT {n : Nat} (c s g₁ g₂ : Vec n) : Vec n × Vec n :=
  (fun i => c i * g₁ i + s i * g₂ i, fun i => c i * g₂ i - s i * g₁ i)

/-- `fT` is the adjoint of `f`: `⟨g, f v⟩ = ⟨fT g, v⟩` for all `g`, `v`. -/
abbrev IsAdjoint {m n : Nat} (f : Vec n → Vec m) (fT : Vec m → Vec n) : Prop :=
  ∀ (g : Vec m) (v : Vec n), dot g (f v) = dot (fT g) v

/-! ## Small facts about the model -/

/-- `⟨g, a + b⟩ = ⟨g, a⟩ + ⟨g, b⟩`. -/
theorem dot_vecAdd_right {n : Nat} (g a b : Vec n) : dot g (vecAdd a b) = dot g a + dot g b :=
  calc dot g (vecAdd a b)
      = sum n (fun i => g i * (a i + b i)) := rfl
    _ = sum n (fun i => g i * a i + g i * b i) :=
        sum_congr n (fun i => Int.mul_add (g i) (a i) (b i))
    _ = dot g a + dot g b := sum_add n (fun i => g i * a i) (fun i => g i * b i)

/-- `⟨a + b, v⟩ = ⟨a, v⟩ + ⟨b, v⟩`. -/
theorem dot_vecAdd_left {n : Nat} (a b v : Vec n) : dot (vecAdd a b) v = dot a v + dot b v :=
  calc dot (vecAdd a b) v
      = sum n (fun i => (a i + b i) * v i) := rfl
    _ = sum n (fun i => a i * v i + b i * v i) :=
        sum_congr n (fun i => Int.add_mul (a i) (b i) (v i))
    _ = dot a v + dot b v := sum_add n (fun i => a i * v i) (fun i => b i * v i)

/-- `⟨G, A B⟩` written as one triple sum over rows `i`, columns `j` and the inner index `l`. -/
theorem frob_matMul_expand {m k n : Nat} (G : Mat m n) (A : Mat m k) (B : Mat k n) :
    frob G (matMul A B)
      = sum m (fun i => sum n (fun j => sum k (fun l => G i j * (A i l * B l j)))) :=
  calc frob G (matMul A B)
      = sum m (fun i => sum n (fun j => G i j * sum k (fun l => A i l * B l j))) := rfl
    _ = sum m (fun i => sum n (fun j => sum k (fun l => G i j * (A i l * B l j)))) :=
        sum_congr m (fun i => sum_congr n (fun j =>
          (sum_mul_left k (G i j) (fun l => A i l * B l j)).symm))

/-- The 2×2 identity behind the rotation law, for one index. -/
theorem rotate_pointwise (c s g₁ g₂ x₁ x₂ : Int) :
    g₁ * (c * x₁ - s * x₂) + g₂ * (s * x₁ + c * x₂)
      = (c * g₁ + s * g₂) * x₁ + (c * g₂ - s * g₁) * x₂ := by
  -- `a - b` is `a + -b` by definition; distribute, move the signs out, regroup each product,
  -- then reorder the four summands
  show g₁ * (c * x₁ + -(s * x₂)) + g₂ * (s * x₁ + c * x₂)
      = (c * g₁ + s * g₂) * x₁ + (c * g₂ + -(s * g₁)) * x₂
  rw [Int.mul_add g₁ (c * x₁) (-(s * x₂)), Int.mul_add g₂ (s * x₁) (c * x₂),
    Int.add_mul (c * g₁) (s * g₂) x₁, Int.add_mul (c * g₂) (-(s * g₁)) x₂,
    Int.mul_neg g₁ (s * x₂), Int.neg_mul (s * g₁) x₂,
    mul_swap_left g₁ c x₁, mul_swap_left g₁ s x₂, mul_swap_left g₂ s x₁, mul_swap_left g₂ c x₂,
    add_swap_middle (c * g₁ * x₁) (-(s * g₁ * x₂)) (s * g₂ * x₁) (c * g₂ * x₂),
    Int.add_comm (-(s * g₁ * x₂)) (c * g₂ * x₂)]

/-- The single-token weight gradient: `⟨g, W v⟩ = ⟨g vᵀ, W⟩`. -/
theorem linear_param_adjoint {m n : Nat} (W : Mat m n) (g : Vec m) (v : Vec n) :
    dot g (matVec W v) = frob (outer g v) W :=
  calc dot g (matVec W v)
      = sum m (fun i => g i * sum n (fun j => W i j * v j)) := rfl
    _ = sum m (fun i => sum n (fun j => g i * (W i j * v j))) :=
        sum_congr m (fun i => (sum_mul_left n (g i) (fun j => W i j * v j)).symm)
    _ = sum m (fun i => sum n (fun j => g i * v j * W i j)) :=
        sum_congr m (fun i => sum_congr n (fun j => mul_swap_right (g i) (W i j) (v j)))
    _ = frob (outer g v) W := rfl

/-- The element-wise gain `v ↦ w ⊙ v` is its own adjoint: `⟨g, w ⊙ v⟩ = ⟨w ⊙ g, v⟩`. -/
theorem scale_adjoint {n : Nat} (w g v : Vec n) : dot g (hadamard w v) = dot (hadamard w g) v :=
  calc dot g (hadamard w v)
      = sum n (fun i => g i * (w i * v i)) := rfl
    _ = sum n (fun i => w i * g i * v i) :=
        sum_congr n (fun i => mul_swap_left (g i) (w i) (v i))
    _ = dot (hadamard w g) v := rfl

end PyML
