"""Watch (and bend) the copies a serving engine's loader makes, without reading its code.

`LoaderCopies` is a TorchDispatchMode active while the engine's own loader runs. It

* records which of the tensors we handed the loader it actually read (a tensor never read was
  skipped or renamed by the loader: a placement error), and
* for a chosen set of engine storages (parameters the engine keeps as plain tensors), turns the
  loader's `copy_` into them into an XOR of the source: feeding the loader the XOR mask
  `new ^ old` then changes those parameters in place, through the loader's own slicing.

A write into a chosen storage that is not a plain copy — another dtype (a conversion), another
shape, a second copy overlapping an earlier one, or any other in-place op — is not performed;
the storage is reported `irregular` so the caller overwrites that parameter's whole group
instead (overwrite does not depend on what the storage held).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

INT_BY_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def storage_key(t: torch.Tensor) -> int:
    """Identity of a tensor's storage (0 for meta/empty tensors, which identify nothing)."""
    if t.device.type == "meta" or t.untyped_storage().nbytes() == 0:
        return 0
    return t.untyped_storage().data_ptr()


class LoaderCopies(TorchDispatchMode):
    """Record source reads; XOR copies into `xor_storages` (see module doc).

    Args:
        sources: storage key → canonical name of every tensor handed to the loader.
        xor_storages: storage keys of engine parameters to update by XOR.
    """

    def __init__(self, sources: dict[int, str], xor_storages: set[int]) -> None:
        super().__init__()
        self.sources = sources
        self.xor_storages = xor_storages
        self.consumed: set[str] = set()
        self.irregular: set[int] = set()
        self.xored: set[int] = set()
        self._written: dict[int, list[tuple[int, int]]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                name = self.sources.get(storage_key(leaf))
                if name is not None:
                    self.consumed.add(name)
        target = self._mutated_target(func, args)
        if target is None:
            return func(*args, **kwargs)
        dst = args[0]
        if func is torch.ops.aten.copy_.default and self._plain_copy(target, dst, args[1]):
            width = dst.element_size()
            dst.view(INT_BY_WIDTH[width]).bitwise_xor_(args[1].view(INT_BY_WIDTH[width]))
            self.xored.add(target)
            return dst
        self.irregular.add(target)  # not performed: the caller overwrites this group instead
        return dst

    def _mutated_target(self, func: Any, args: tuple[Any, ...]) -> int | None:
        """The chosen storage this op writes into, if any."""
        schema = getattr(func, "_schema", None)
        if schema is None:
            return None
        for arg, value in zip(schema.arguments, args, strict=False):
            if arg.alias_info is not None and arg.alias_info.is_write \
                    and isinstance(value, torch.Tensor):
                key = storage_key(value)
                if key in self.xor_storages:
                    return key
        return None

    def _plain_copy(self, key: int, dst: torch.Tensor, src: Any) -> bool:
        if not isinstance(src, torch.Tensor) or src.dtype != dst.dtype or src.shape != dst.shape \
                or not dst.is_contiguous() or src.device != dst.device:
            return False
        start = int(dst.storage_offset()) * dst.element_size()
        span = (start, start + dst.numel() * dst.element_size())
        spans = self._written.setdefault(key, [])
        if any(a < span[1] and span[0] < b for a, b in spans):
            return False  # a second write over the same bits: XOR twice would cancel
        spans.append(span)
        return True
