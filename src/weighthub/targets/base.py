"""The Target protocol: what a receiver needs from the place weights live.

Lifecycle (the receiver drives it, one transaction at a time):
    held()            the committed version the target holds, or None
    specs()           its tensor table, or None if it holds nothing yet
    peek()            read-only bit views of what it holds now (while staging, before the pause)
    open(specs)       writable bit views by canonical name; materializes an empty target
                      (allocated, not yet visible under its final name/place)
    ... the receiver applies, verifies digests ...
    journal_step(plan)  optional, before each step is applied: `plan()` lists the ranges (and
                      positions) the step may write; a file target updated in place journals
                      their old words durably first, for recovery after a crash
    commit(held)      make the new version durable and visible; record what is held
    abort()           discard whatever open() materialized (bits were already rolled back)

A target shared between processes (a file) also locks itself from open to commit/abort, and
held() inside that transaction answers what it held when opened.

`TargetWrapper` forwards all of these to an inner target; wrappers (fp8 blocks, read leases,
an engine's parameters) override only what they change. `weighthub.testing.TargetTests` is the
behaviour every target must have.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import UsageError
from ..tensors import TensorSpec, Words, bits, word_view

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class Held:
    """What a target holds: a committed version of a model from a store."""

    store: str
    model: str
    version: int
    root: str


class Target(Protocol):
    def held(self) -> Held | None: ...

    def specs(self) -> list[TensorSpec] | None: ...

    def peek(self) -> Mapping[str, Words]: ...

    def open(self, specs: list[TensorSpec]) -> Mapping[str, Words]: ...

    def commit(self, held: Held) -> None: ...

    def abort(self) -> None: ...


class TargetWrapper:
    """A Target that forwards every call to `inner`; subclasses override only what they change.

    Wrappers add behaviour around a target's lifecycle (a lease gate around open/commit/abort,
    re-quantization or an engine push at commit), while the bits the receiver applies and
    verifies stay the inner target's. A subclass that overrides `open`, `commit` or `abort`
    calls the inner one itself (`self.inner.commit(held)`), at the point its own work needs.
    """

    def __init__(self, inner: Target) -> None:
        self.inner = inner

    def held(self) -> Held | None:
        return self.inner.held()

    def specs(self) -> list[TensorSpec] | None:
        return self.inner.specs()

    def peek(self) -> Mapping[str, Words]:
        return self.inner.peek()

    def open(self, specs: list[TensorSpec]) -> Mapping[str, Words]:
        return self.inner.open(specs)

    def journal_step(self, plan: Plan) -> None:
        journal_step(self.inner, plan)

    def commit(self, held: Held) -> None:
        self.inner.commit(held)

    def abort(self) -> None:
        self.inner.abort()


# what a step may write: (words of a range of a view, positions in it or None: all of them),
# or None when it cannot be known ahead (then a journaling target covers all it maps)
Plan = Callable[[], "list[tuple[np.ndarray, np.ndarray | None]] | None"]


def journal_step(target: Target, plan: Plan) -> None:
    """Offer `plan` to `target` before a step (`journal_step` is optional in the protocol);
    the plan is computed only if the target journals."""
    hook = getattr(target, "journal_step", None)
    if hook is not None:
        hook(plan)


class Views(dict[str, Words]):
    """A target's views (name → words) that it keeps between transactions while its tensors
    stay the same (`StateDictTarget`), and what the receiver derived from them once: `layouts`
    maps a tuple of names to their `unique_views`, already checked disjoint
    (`receive.apply.layout_of`). Rebuilding both cost ~10 µs a tensor in every pause.
    `addresses`: what `host_words_at` read of its host views, by name."""

    __slots__ = ("addresses", "layouts")

    def __init__(self, views: Mapping[str, Words]) -> None:
        super().__init__(views)
        self.layouts: dict[tuple[str, ...], dict[str, str]] = {}
        self.addresses: dict[str, tuple[np.ndarray, int, np.dtype, int]] = {}


def host_words_at(views: Mapping[str, Words], name: str
                  ) -> tuple[np.ndarray, int, np.dtype, int] | None:
    """(view, address, word type, size) of view `name` if it is C-contiguous host words, else
    None: for kernels that reach many views' words through their addresses. Remembered per
    view object in a `Views` (kept views keep their arrays; reading an address costs ~1.4 µs)."""
    view = views[name]
    if not isinstance(view, np.ndarray):
        return None
    memo = views.addresses if isinstance(views, Views) else None
    hit = memo.get(name) if memo is not None else None
    if hit is None or hit[0] is not view:
        hit = (view, view.ctypes.data if view.flags.c_contiguous else -1, view.dtype, view.size)
        if memo is not None:
            memo[name] = hit
    return None if hit[1] < 0 else hit


class KeptViews:
    """A target's views, the same `Views` object while no tensor changed its storage address,
    dtype, shape, strides or device (comparing that costs ~0.5 µs a tensor, building the views
    ~6). Kept views hold their tensors' storage: a replaced tensor's lives until the next
    `of` (or `drop`)."""

    __slots__ = ("_kept",)

    def __init__(self) -> None:
        self._kept: tuple[list[tuple[Any, ...]], Views] | None = None

    def of(self, tensors: Mapping[str, torch.Tensor], backend: str) -> Views:
        layout = [(n, t.data_ptr(), t.dtype, t.shape, t.stride(), t.device)
                  for n, t in tensors.items()]
        if self._kept is None or self._kept[0] != layout:
            self._kept = (layout, Views(views_of(tensors, backend)))
        return self._kept[1]

    def drop(self) -> None:
        self._kept = None


def unique_views(views: Mapping[str, Words]) -> dict[str, str]:
    """Map each name to the first name sharing its exact memory (tied weights).

    Applying a delta twice through two aliases of one buffer would corrupt it, so the receiver
    applies only through the first name and checks the others' digests.
    """
    first: dict[tuple[object, ...], str] = {}
    out = {}
    for name, v in views.items():
        if isinstance(v, np.ndarray):
            key: tuple[object, ...] = ("cpu", v.ctypes.data, v.size, v.dtype.itemsize)
        else:  # a torch word view: its device's address space
            key = (str(v.device), v.data_ptr(), v.numel(), v.element_size())
        out[name] = first.setdefault(key, name)
    return out


def host_views(views: Mapping[str, Words], user: str) -> dict[str, np.ndarray]:
    """The views as host numpy words, for code that works on host memory only (`user`, named in
    the error); UsageError naming the tensors a target holds on a device."""
    device = sorted(n for n, v in views.items() if not isinstance(v, np.ndarray))
    if device:
        raise UsageError(f"{user} works on host memory, but the target holds {device[:3]} on a "
                         "device (torch words): give it CPU tensors")
    return {n: v for n, v in views.items() if isinstance(v, np.ndarray)}


BACKENDS = ("auto", "host", "torch")


def check_backend(backend: str) -> str:
    """Refuse a target backend other than "auto", "host" or "torch" (UsageError)."""
    if backend not in BACKENDS:
        raise UsageError(f"target backend={backend!r}: pass one of {list(BACKENDS)} (auto: "
                         "where each tensor lives; host: CPU tensors only; torch: the device "
                         "code on every tensor)")
    return backend


def check_device(device: str | torch.device, backend: str) -> torch.device:
    """The device an empty target materializes on (UsageError for one torch cannot name, or a
    device with backend "host")."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"target device={device!r} is not a torch device: {exc}") from None
    if dev.type not in ("cpu", "cuda"):
        raise UsageError(f"target device={dev}: weighthub materializes into host or CUDA memory")
    if dev.type != "cpu" and backend == "host":
        raise UsageError(f"target device={dev} with backend 'host': the host backend applies "
                         "to CPU tensors only; pass backend='auto'")
    return dev


def views_of(tensors: Mapping[str, torch.Tensor], backend: str) -> dict[str, Words]:
    """Writable bit views of a target's tensors, as the backend that applies to each wants them:
    host numpy words for CPU tensors (unless backend "torch"), torch word views on the tensor's
    device otherwise.

    Raises:
        UsageError: a tensor on a device with backend "host", on a device that is neither the
            host nor CUDA (meta), tensors on more than one CUDA device, a non-contiguous tensor
            (its flat view would be a copy, and an update would not reach it), or a dtype
            weighthub does not carry.
    """
    out: dict[str, Words] = {}
    devices: dict[str, str] = {}  # CUDA device → a tensor on it
    for name, t in tensors.items():
        if t.device.type not in ("cpu", "cuda"):
            raise UsageError(f"tensor {name!r} is on {t.device}: weighthub applies into host or "
                             "CUDA memory; materialize the model on one of those first")
        on_device = t.device.type != "cpu"
        if on_device:
            devices.setdefault(str(t.device), name)
            if len(devices) > 1:
                (d0, n0), (d1, n1) = list(devices.items())[:2]
                raise UsageError(f"the target's tensors are on several CUDA devices ({n0!r} on "
                                 f"{d0}, {n1!r} on {d1}): one receiver applies into one device "
                                 "(and the host); give each device's tensors a receiver of "
                                 "their own, as tensor-parallel ranks do")
        if on_device and backend == "host":
            raise UsageError(f"tensor {name!r} is on {t.device}, and this target was made with "
                             "backend='host' (CPU tensors only): pass backend='auto'")
        if not t.is_contiguous():  # its flat words would be a copy: updates would not land
            raise UsageError(f"tensor {name!r} is not contiguous (shape {tuple(t.shape)}, "
                             f"strides {t.stride()}): weighthub updates flat words in place; "
                             "give the target the contiguous tensor the model itself reads")
        out[name] = word_view(t) if on_device or backend == "torch" else bits(t)
    return out
