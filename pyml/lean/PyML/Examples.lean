/-
Hand-written model skeletons: they type-check because every junction's dims agree. The generator
writes skeletons of the same form under `Generated/` (see `README.md`).
-/
import PyML.Shape

namespace PyML

/-- The MLP 64 → 128 → 10. -/
def mlpSkeleton : Chain 64 10 :=
  .layer (Layer.dense 64 128) (.layer (Layer.dense 128 10) .nil)

/-- A decoder-block-like chain of width 576: a residual attention path (norm gain, output
projection) and a residual MLP path (norm gain, up projection to 1536, down projection). -/
def decoderBlockSkeleton : Chain 576 576 :=
  .residual (.layer (Layer.gain 576) (.layer (Layer.dense 576 576) .nil))
    (.residual
      (.layer (Layer.gain 576) (.layer (Layer.dense 576 1536) (.layer (Layer.dense 1536 576) .nil)))
      .nil)

/-- Two decoder blocks composed: a chain `576 → 576` again. -/
def twoBlocksSkeleton : Chain 576 576 := decoderBlockSkeleton.append decoderBlockSkeleton

/-- The MLP skeleton's backward map is the adjoint of its forward map. -/
theorem mlpSkeleton_adjoint : IsAdjoint mlpSkeleton.forward mlpSkeleton.backward :=
  chain_adjoint mlpSkeleton

/-- The backward chain of the decoder block runs from its output width back to its input width. -/
def decoderBlockBackward : Chain 576 576 := decoderBlockSkeleton.transposed

/-- The composed blocks' backward map is the adjoint of their forward map. -/
theorem twoBlocksSkeleton_adjoint : IsAdjoint twoBlocksSkeleton.forward twoBlocksSkeleton.backward :=
  chain_adjoint twoBlocksSkeleton

end PyML
