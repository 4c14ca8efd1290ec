"""Graph passes run by the builder. One pass = one function in one file."""

from engine_core.passes.constant_folding import fold_constants
from engine_core.passes.dead_code import eliminate_dead_code
from engine_core.passes.fold_conv_batchnorm import fold_conv_batchnorm
from engine_core.passes.shape_inference import infer_shapes

#: Folding passes, run before the precision pass (builder.build_plan); each returns its change count.
PRE_PASSES = (fold_constants, fold_conv_batchnorm)
#: Fusions and clean-up, run after the precision pass.
FUSION_PASSES = (eliminate_dead_code,)
#: The whole optimization pipeline (without the precision pass, which needs the build config), in order.
PIPELINE = PRE_PASSES + FUSION_PASSES

__all__ = ["FUSION_PASSES", "PIPELINE", "PRE_PASSES", "eliminate_dead_code", "fold_constants", "fold_conv_batchnorm", "infer_shapes"]
