"""Kiln engine core: ONNX -> network IR -> plan -> execution (API after the reference's TensorRT API).

    import engine_core as kiln
    builder = kiln.Builder()
    network = builder.create_network()
    kiln.OnnxParser(network).parse_from_file("model.onnx")
    config = builder.create_builder_config()
    plan = builder.build_serialized_network(network, config)
    context = kiln.Runtime().deserialize_cuda_engine(plan).create_execution_context()
    outputs = context.infer({"x": x})
"""

from engine_core.backends.registry import available_backends
from engine_core.builder import Builder, build_plan
from engine_core.builder_config import BuilderConfig, OptimizationProfile
from engine_core.calibration import (
    CalibrationAlgoType,
    IInt8Calibrator,
    IInt8EntropyCalibrator2,
    IInt8MinMaxCalibrator,
    IInt8PercentileCalibrator,
)
from engine_core.cuda.view import DeviceRows, DeviceView
from engine_core.error_recorder import ErrorCode, ErrorRecorder, IErrorRecorder
from engine_core.errors import (
    BuildError,
    DeviceMemoryError,
    ExecutionError,
    KilnError,
    ParseError,
    PlanFormatError,
    ShapeError,
)
from engine_core.inspector import IDebugListener
from engine_core.logger import Logger, Severity
from engine_core.network import NetworkDefinition
from engine_core.onnx import OnnxParser, ParserError
from engine_core.plugins import PluginDef, get_plugin_registry, register_plugin
from engine_core.refit import Refitter
from engine_core.runtime import (
    CudaEngine,
    EngineInspector,
    ExecutionContext,
    IOutputAllocator,
    IProfiler,
    Runtime,
)
from engine_core.types import (
    BuilderFlag,
    DataType,
    EngineCapability,
    ExecutionContextAllocationStrategy,
    HardwareCompatibilityLevel,
    LayerInformationFormat,
    MemoryPoolType,
    NetworkDefinitionCreationFlag,
    ProfilingVerbosity,
    TempfileControlFlag,
    TensorFormat,
    TensorIOMode,
    TensorLocation,
    nptype,
)
from engine_core.version import __version__

__all__ = [
    "BuildError", "Builder", "DeviceMemoryError", "DeviceRows", "DeviceView", "ErrorCode", "ErrorRecorder", "IDebugListener", "IErrorRecorder", "PluginDef",
    "Refitter", "get_plugin_registry", "register_plugin", "BuilderConfig", "BuilderFlag", "CalibrationAlgoType", "IInt8Calibrator", "IInt8EntropyCalibrator2", "IInt8MinMaxCalibrator", "IInt8PercentileCalibrator", "EngineCapability", "HardwareCompatibilityLevel", "TempfileControlFlag", "TensorFormat", "CudaEngine", "DataType", "EngineInspector",
    "ExecutionContext", "ExecutionContextAllocationStrategy", "ExecutionError", "IOutputAllocator", "IProfiler",
    "KilnError", "LayerInformationFormat", "Logger", "MemoryPoolType", "NetworkDefinition",
    "NetworkDefinitionCreationFlag", "OnnxParser", "OptimizationProfile", "ParseError", "ParserError",
    "PlanFormatError", "ProfilingVerbosity", "Runtime", "Severity", "ShapeError", "TensorIOMode",
    "TensorLocation", "__version__", "available_backends", "build_plan", "nptype",
]
