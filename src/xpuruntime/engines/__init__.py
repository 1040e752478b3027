"""Engine adapters and their registry.

Adapter modules import their backend (onnxruntime, openvino) only inside methods, so
registering them here keeps ``import xpuruntime`` light.
"""

from ._engine import Engine, EngineContext
from ._registry import EngineRegistry, engines
from .onnxrt import OnnxRuntimeEngine
from .openvino import OpenVinoEngine
from .qnn import QnnEngine
from .tensorrt import TensorRTEngine

for _engine in (OnnxRuntimeEngine, OpenVinoEngine, TensorRTEngine, QnnEngine):
    engines.register(_engine)

__all__ = [
    "Engine",
    "EngineContext",
    "EngineRegistry",
    "OnnxRuntimeEngine",
    "OpenVinoEngine",
    "QnnEngine",
    "TensorRTEngine",
    "engines",
]
