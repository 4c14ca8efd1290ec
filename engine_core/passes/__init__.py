"""Graph passes run by the builder. One pass = one function in one file."""

from engine_core.passes.constant_folding import fold_constants
from engine_core.passes.dead_code import eliminate_dead_code
from engine_core.passes.fold_conv_batchnorm import fold_conv_batchnorm
from engine_core.passes.shape_inference import infer_shapes

#: The optimization pipeline, in order; each returns how many changes it made.
PIPELINE = (fold_constants, fold_conv_batchnorm, eliminate_dead_code)

__all__ = ["PIPELINE", "eliminate_dead_code", "fold_constants", "fold_conv_batchnorm", "infer_shapes"]
