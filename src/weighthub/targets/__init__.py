"""Targets: where a receiver's weights live, and how they are opened for in-place apply."""

from .base import Held, Target
from .converted import Fp8BlockTarget, quantize_fp8_blocks
from .module import ModuleTarget
from .safetensors_file import SafetensorsTarget, load_checkpoint
from .state_dict import StateDictTarget

# the vLLM worker extension is imported as weighthub.engines.vllm (it needs the receiver, which
# imports this package)
__all__ = ["Fp8BlockTarget", "Held", "ModuleTarget", "SafetensorsTarget", "StateDictTarget", "Target",
           "load_checkpoint", "quantize_fp8_blocks"]
