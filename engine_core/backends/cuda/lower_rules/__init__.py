"""The CUDA lowering rules by family, each module registering its rules (``lowering_rule``) when imported:
pointwise (generated kernels), movement (views and copies), fill (ConstantOfShape), rows (softmax, reductions), norm, pool, gemm (float
GEMMs and the shared epilogue), attention, conv; common holds what several families share. The INT8 rules live in
int8_gemm.py and int8_conv.py. ``engine_core.backends.cuda.lowering`` (the driver) imports them all."""
