/-
The finite sum over `Fin n` and the small lemma library every law is proved with:
the unfolding equation, sum of zeros, sum of sums, pulling a constant out on either side,
congruence, swapping two sums, and picking one term out with an indicator.
Also three regroupings of `Int` products and sums used pointwise inside the sums.
-/
namespace PyML

/-! ## Regroupings in `Int` -/

/-- `a * (b * c) = b * a * c`. -/
theorem mul_swap_left (a b c : Int) : a * (b * c) = b * a * c := by
  rw [Int.mul_left_comm a b c, Int.mul_assoc b a c]

/-- `a * (b * c) = a * c * b`. -/
theorem mul_swap_right (a b c : Int) : a * (b * c) = a * c * b := by
  rw [Int.mul_comm b c, Int.mul_assoc a c b]

/-- `a + b + (c + d) = a + c + (b + d)`: swap the two middle summands. -/
theorem add_swap_middle (a b c d : Int) : a + b + (c + d) = a + c + (b + d) := by
  rw [Int.add_assoc a b (c + d), Int.add_left_comm b c d, ← Int.add_assoc a c (b + d)]

/-- `(if c then a * b else 0) = (if c then a else 0) * b`. -/
theorem ite_mul_zero (c : Prop) [Decidable c] (a b : Int) :
    (if c then a * b else 0) = (if c then a else 0) * b := by
  by_cases h : c
  · rw [if_pos h, if_pos h]
  · rw [if_neg h, if_neg h, Int.zero_mul]

/-! ## The sum -/

/-- `sum n f = f 0 + f 1 + ... + f (n-1)`, by structural recursion on `n`. -/
def sum : (n : Nat) → (Fin n → Int) → Int
  | 0, _ => 0
  | n + 1, f => f ⟨0, Nat.zero_lt_succ n⟩ + sum n (fun i => f i.succ)

/-- The unfolding equation, by definition. -/
theorem sum_succ (n : Nat) (f : Fin (n + 1) → Int) :
    sum (n + 1) f = f ⟨0, Nat.zero_lt_succ n⟩ + sum n (fun i => f i.succ) := rfl

/-- A sum of zeros is zero. -/
theorem sum_zero : (n : Nat) → sum n (fun _ => 0) = 0
  | 0 => rfl
  | n + 1 => by rw [sum_succ, sum_zero n, Int.add_zero]

/-- Congruence: sums of pointwise equal terms are equal. -/
theorem sum_congr (n : Nat) {f g : Fin n → Int} (h : ∀ i, f i = g i) : sum n f = sum n g :=
  congrArg (sum n) (funext h)

/-- Sum of sums: the sum of `f i + g i` is the sum of `f` plus the sum of `g`. -/
theorem sum_add : (n : Nat) → (f g : Fin n → Int) →
    sum n (fun i => f i + g i) = sum n f + sum n g
  | 0, _, _ => (Int.add_zero 0).symm
  | n + 1, f, g => by
    -- unfold the three sums once, use the claim for `n`, then swap the middle summands
    rw [sum_succ, sum_succ n f, sum_succ n g, sum_add n (fun i => f i.succ) (fun i => g i.succ)]
    exact add_swap_middle _ _ _ _

/-- A constant factor on the left comes out of the sum. -/
theorem sum_mul_left : (n : Nat) → (a : Int) → (f : Fin n → Int) →
    sum n (fun i => a * f i) = a * sum n f
  | 0, a, _ => (Int.mul_zero a).symm
  | n + 1, a, f => by
    -- unfold once, use the claim for `n`, then distribute `a` over the head and the rest
    rw [sum_succ, sum_succ n f, sum_mul_left n a (fun i => f i.succ),
      Int.mul_add a (f ⟨0, Nat.zero_lt_succ n⟩) (sum n (fun i => f i.succ))]

/-- A constant factor on the right comes out of the sum. -/
theorem sum_mul_right : (n : Nat) → (a : Int) → (f : Fin n → Int) →
    sum n (fun i => f i * a) = sum n f * a
  | 0, a, _ => (Int.zero_mul a).symm
  | n + 1, a, f => by
    -- unfold once, use the claim for `n`, then distribute `a` over the head and the rest
    rw [sum_succ, sum_succ n f, sum_mul_right n a (fun i => f i.succ),
      Int.add_mul (f ⟨0, Nat.zero_lt_succ n⟩) (sum n (fun i => f i.succ)) a]

/-- Swapping two sums. -/
theorem sum_comm : (n m : Nat) → (f : Fin n → Fin m → Int) →
    sum n (fun i => sum m (fun j => f i j)) = sum m (fun j => sum n (fun i => f i j))
  | 0, m, _ => (sum_zero m).symm
  | n + 1, m, f => by
    -- peel the first outer term, swap the rest by the claim for `n`, merge the two inner sums
    rw [sum_succ, sum_comm n m (fun i j => f i.succ j),
      ← sum_add m (fun j => f ⟨0, Nat.zero_lt_succ n⟩ j) (fun j => sum n (fun i => f i.succ j))]
    rfl

/-- An indicator picks one term out of a sum: `Σ i, (if k = i then f i else 0) = f k`. -/
theorem sum_ite_eq : (n : Nat) → (k : Fin n) → (f : Fin n → Int) →
    sum n (fun i => if k = i then f i else 0) = f k
  | 0, k, _ => k.elim0
  | n + 1, ⟨0, _⟩, f => by
    -- `k` is the first index: the head term is `f k` and every later term is `0`
    show sum (n + 1) (fun i => if (⟨0, Nat.zero_lt_succ n⟩ : Fin (n + 1)) = i then f i else 0)
      = f ⟨0, Nat.zero_lt_succ n⟩
    have h0 : (⟨0, Nat.zero_lt_succ n⟩ : Fin (n + 1)) = ⟨0, Nat.zero_lt_succ n⟩ := rfl
    have hz : ∀ i : Fin n,
        (if (⟨0, Nat.zero_lt_succ n⟩ : Fin (n + 1)) = i.succ then f i.succ else 0) = 0 := by
      intro i
      -- the condition is stated with its type, so `h` below has a known type when elaborated
      have hne0 : ¬ ((⟨0, Nat.zero_lt_succ n⟩ : Fin (n + 1)) = i.succ) := fun h =>
        Nat.succ_ne_zero i.val ((Fin.val_succ i).symm.trans (congrArg Fin.val h).symm)
      exact if_neg hne0
    rw [sum_succ, if_pos h0, sum_congr n hz, sum_zero n, Int.add_zero]
  | n + 1, ⟨k + 1, hk⟩, f => by
    -- `k` is a later index: the head term is `0` and the rest is the claim one index down
    have hk' : k < n := by omega
    show sum (n + 1) (fun i => if (⟨k + 1, hk⟩ : Fin (n + 1)) = i then f i else 0)
      = f (Fin.succ ⟨k, hk'⟩)
    have hne : ¬ ((⟨k + 1, hk⟩ : Fin (n + 1)) = ⟨0, Nat.zero_lt_succ n⟩) :=
      fun h => Nat.succ_ne_zero k (congrArg Fin.val h)
    have hs : ∀ i : Fin n,
        (if (⟨k + 1, hk⟩ : Fin (n + 1)) = i.succ then f i.succ else 0)
          = (if (⟨k, hk'⟩ : Fin n) = i then f i.succ else 0) := by
      intro i
      by_cases h : (⟨k, hk'⟩ : Fin n) = i
      · have hc : (⟨k + 1, hk⟩ : Fin (n + 1)) = i.succ := congrArg Fin.succ h
        rw [if_pos hc, if_pos h]
      · have hc : ¬ ((⟨k + 1, hk⟩ : Fin (n + 1)) = i.succ) :=
          fun h' => h ((Fin.succ_inj (a := ⟨k, hk'⟩) (b := i)).mp h')
        rw [if_neg hc, if_neg h]
    rw [sum_succ, if_neg hne, Int.zero_add, sum_congr n hs,
      sum_ite_eq n ⟨k, hk'⟩ (fun i => f i.succ)]

end PyML
