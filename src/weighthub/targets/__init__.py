"""Targets: where a receiver's weights live, and how they are opened for in-place apply."""

from .base import Held, Target
from .module import ModuleTarget
from .safetensors_file import SafetensorsTarget, load_checkpoint
from .state_dict import StateDictTarget

__all__ = ["Held", "ModuleTarget", "SafetensorsTarget", "StateDictTarget", "Target",
           "load_checkpoint"]
