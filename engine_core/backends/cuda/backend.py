"""``CudaBackend``: the CUDA backend behind the interface of ``engine_core.backends.base``.

Build time: which lowering options this GPU and its libraries allow (cuDNN, cuBLASLt, INT8 requantization, cuDNN
INT8 graphs, the sm_90 INT8 GEMM), then ``prepare_plan`` (tactics, CUBINs, arena size). Run time: the plan's
compatibility with this GPU and Kiln, then ``CudaEngineState``. The library probes are imported when first used,
as before this class: registering the backend, or building for the CPU, loads none of them.
"""

from __future__ import annotations

from typing import Any

from engine_core.backends.base import BackendBuild, Inferred
from engine_core.builder_config import BuilderConfig
from engine_core.compat import check_plan_compatibility, device_arch
from engine_core.errors import PlanFormatError
from engine_core.ir import Graph
from engine_core.plan import Plan
from engine_core.timing_cache import TimingCache
from engine_core.types import BuilderFlag
from engine_core.version import __version__


class CudaBackend:
    """The "cuda" backend: kernels lowered per layer and compiled by NVRTC, run by the CUDA runner."""

    name = "cuda"
    uses_timing_cache = True  # GEMM tactics and cuDNN plans are timed
    workspace_limited = True  # the activation arena is device memory

    def int8_convolutions(self) -> bool:
        """When cuDNN builds INT8 graphs here (faster than float convolutions of the dequantized weights)."""
        from engine_core.backends.cuda.cudnn_conv import int8_unsupported

        return not int8_unsupported()

    def compile(self, graph: Graph, inferred: Inferred, config: BuilderConfig,
                cache: TimingCache | None) -> BackendBuild:
        """Tactics, CUBINs and the planned arena size; every layer the lowering leaves out runs on the host
        ("shape"). The build info also says why each INT8 path is off."""
        from engine_core.backends.cuda import prepare_plan
        from engine_core.backends.cuda.cublaslt import available as cublaslt_available
        from engine_core.backends.cuda.cudnn_conv import available as cudnn_available
        from engine_core.backends.cuda.cudnn_conv import int8_unsupported
        from engine_core.backends.cuda.int8_gemm import requant_unsupported
        from engine_core.backends.cuda.lowering import LoweringOptions
        from engine_core.backends.cuda.qgemm import available as qgemm_available

        requant_reason = requant_unsupported() if cublaslt_available() else "no cuBLASLt"
        cudnn_int8_reason = int8_unsupported() if any(n.op_type == "QConv" for n in graph.nodes) \
            else "no kiln.QConv layer"
        options = LoweringOptions(tf32=config.get_flag(BuilderFlag.TF32), cudnn=cudnn_available(),
                                  cublaslt=cublaslt_available(), int8_requant=not requant_reason,
                                  cudnn_int8=not cudnn_int8_reason, qgemm_sm90=qgemm_available(),
                                  strict_fp32_nchw=True)
        build = prepare_plan(graph, inferred, options=options, cache=cache)
        info = build.info
        info["int8_requant_unsupported"] = requant_reason
        info["cudnn_int8_unsupported"] = cudnn_int8_reason
        return BackendBuild(tactics={n.name: build.tactics.get(n.name, "shape") for n in graph.nodes},
                            kernels=build.kernels, arch=build.arch, device_memory_size=build.device_memory_size,
                            info=info)

    def load(self, plan: Plan) -> Any:
        """Per-engine device state (weights, kernels), after the plan's compatibility (Kiln version, GPU arch,
        hardware level) is checked: a plan this GPU cannot run is refused with the reason instead of failing
        inside the driver."""
        reason = check_plan_compatibility(plan.compat_meta(), device_arch(), __version__)
        if reason:
            raise PlanFormatError(reason)
        from engine_core.backends.cuda import engine_state

        return engine_state(plan)
