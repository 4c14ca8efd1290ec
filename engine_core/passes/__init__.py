"""Graph passes run by the builder. One pass = one function in one file; each returns its change count."""

from engine_core.passes.collapse_layout_chains import collapse_layout_chains
from engine_core.passes.constant_folding import fold_constants
from engine_core.passes.conv_1d_as_2d import conv_1d_as_2d
from engine_core.passes.dead_code import eliminate_dead_code
from engine_core.passes.decompose_batchnorm import decompose_batchnorm
from engine_core.passes.eliminate_identity_casts import eliminate_identity_casts
from engine_core.passes.eliminate_transposes import eliminate_transposes
from engine_core.passes.fold_attention_heads import fold_attention_heads
from engine_core.passes.fold_conv_batchnorm import fold_conv_batchnorm
from engine_core.passes.fuse_attention import fuse_attention
from engine_core.passes.fuse_attention_quantize import fuse_attention_quantize
from engine_core.passes.fuse_conv_epilogue import fuse_conv_epilogue
from engine_core.passes.fuse_gelu import fuse_gelu
from engine_core.passes.fuse_layer_norm import fuse_layer_norm
from engine_core.passes.fuse_log_softmax import fuse_log_softmax
from engine_core.passes.fuse_matmul_epilogue import fuse_matmul_epilogue
from engine_core.passes.fuse_norm_dequantize import fuse_norm_dequantize
from engine_core.passes.fuse_norm_quantize import fuse_norm_quantize
from engine_core.passes.fuse_pointwise_chain import fuse_pointwise_chain
from engine_core.passes.fuse_qdq_conv import fuse_qdq_conv
from engine_core.passes.fuse_qdq_matmul import fuse_qdq_matmul
from engine_core.passes.fuse_rms_norm import fuse_rms_norm
from engine_core.passes.fuse_rotary import fuse_rotary
from engine_core.passes.fuse_skip_layer_norm import fuse_skip_layer_norm
from engine_core.passes.merge_parallel_qmatmuls import merge_parallel_qmatmuls
from engine_core.passes.narrow_attention_mask import narrow_attention_mask
from engine_core.passes.resolve_shape_operands import resolve_shape_operands
from engine_core.passes.shape_inference import infer_shapes
from engine_core.passes.split_packed_projection import split_packed_projections

#: Folding and rewriting passes, run before the precision pass (builder.build_plan). conv_1d_as_2d comes after
#: fold_conv_batchnorm (which folds into 1-D convs too), so the BN is folded before the conv is rewritten.
PRE_PASSES = (fold_constants, fold_conv_batchnorm, conv_1d_as_2d)
#: Fusions, then clean-up, run after the precision pass. Order matters: eliminate_identity_casts first (the
#: precision pass leaves casts to the type a tensor already has, which would hide patterns); the normalization, GELU and
#: attention patterns are matched while their parts are still plain ONNX nodes; the epilogue fusions
#: then absorb the Gelu/Relu after a GEMM or conv; fuse_attention must see K's Transposes before
#: eliminate_transposes merges them; fold_attention_heads then drops the head split/merge copies around each
#: Attention (3-D form) before eliminate_transposes or the epilogue fusions touch those Reshapes and
#: Transposes; narrow_attention_mask must see the mask's elementwise ops before fuse_pointwise_chain merges
#: them; pointwise chains take whatever pointwise layers are left. fuse_skip_layer_norm comes after
#: fold_attention_heads, whose symbolic shapes do not see through kiln nodes; fuse_norm_quantize and
#: fuse_attention_quantize after the Q/DQ fusions, which leave the QuantizeLinears they fold (and
#: fuse_norm_dequantize the DequantizeLinears); merge_parallel_qmatmuls once the QMatMuls and their int8 inputs
#: are final; decompose_batchnorm just before fuse_pointwise_chain, which merges its Mul/Add with the ReLU.
#: fuse_rotary after narrow_attention_mask (like the other kiln nodes, after the passes that read Q's shape
#: through the rotary's ops) and before fuse_pointwise_chain, which would take its Muls, Neg and Add.
#: resolve_shape_operands, split_packed_projections and collapse_layout_chains see the normalization and GELU fusions'
#: nodes (a chain passes a LayerNormalization) and leave the head split/merge that fuse_attention and
#: fold_attention_heads match.
FUSION_PASSES = (eliminate_identity_casts, fuse_layer_norm, fuse_rms_norm, fuse_gelu, fuse_log_softmax, resolve_shape_operands,
                 split_packed_projections, collapse_layout_chains, fuse_attention, fold_attention_heads,
                 narrow_attention_mask, fuse_rotary, fuse_skip_layer_norm, fuse_qdq_matmul, fuse_qdq_conv,
                 fuse_norm_quantize, fuse_norm_dequantize, fuse_attention_quantize, merge_parallel_qmatmuls,
                 fuse_matmul_epilogue, fuse_conv_epilogue, eliminate_transposes, decompose_batchnorm,
                 fuse_pointwise_chain, eliminate_dead_code)
#: The whole optimization pipeline (without the precision pass, which needs the build config), in order.
PIPELINE = PRE_PASSES + FUSION_PASSES

__all__ = ["FUSION_PASSES", "PIPELINE", "PRE_PASSES", "collapse_layout_chains", "conv_1d_as_2d", "decompose_batchnorm",
           "eliminate_dead_code", "eliminate_identity_casts", "eliminate_transposes",
           "fold_attention_heads", "fold_constants", "fold_conv_batchnorm", "fuse_attention", "fuse_attention_quantize",
           "fuse_conv_epilogue", "fuse_gelu", "fuse_layer_norm", "fuse_log_softmax", "fuse_matmul_epilogue",
           "fuse_norm_dequantize", "fuse_norm_quantize", "fuse_pointwise_chain", "fuse_qdq_conv", "fuse_qdq_matmul",
           "fuse_rms_norm", "fuse_rotary", "fuse_skip_layer_norm", "infer_shapes", "merge_parallel_qmatmuls",
           "narrow_attention_mask", "resolve_shape_operands", "split_packed_projections"]
