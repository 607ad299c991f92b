"""Arrays <-> flat vector: the one place that decides how a model becomes a vector.

Secure aggregation sums vectors, so every site and the coordinator must flatten a model in
the same order, and a vector must never be loaded into a model of another shape.

* :class:`ArrayLayout` (no torch): named arrays (:class:`ArraySpec`: name, shape, numpy
  dtype name) in a fixed order; :meth:`ArrayLayout.flatten` refuses arrays that differ
  (names, order, shape, a non-floating dtype, NaN or inf) and :meth:`ArrayLayout.unflatten`
  casts back. The Flower adapter's round setup carries one (:mod:`fl.flower.setup`).
* :class:`ParameterLayout` (torch): the same for a module's trainable tensors (and, on
  request, its floating-point buffers such as BatchNorm statistics) in ``named_parameters``
  order; :meth:`ParameterLayout.check` refuses a module that differs, naming the difference,
  and :meth:`ParameterLayout.arrays` is its :class:`ArrayLayout`.

Vectors are float64 so no precision is lost for float16/float32/float64 parameters alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

from .errors import FLError

F64 = npt.NDArray[np.float64]


class LayoutError(FLError, ValueError):
    """A module or vector does not match the layout; the message names the mismatch."""


@dataclass(frozen=True)
class ArraySpec:
    """One named array: its shape and its floating dtype (a numpy name, e.g. ``float32``)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)  # Python integers: a hostile shape cannot wrap to 0


@dataclass(frozen=True)
class ArrayLayout:
    """Named arrays in a fixed order, and the flat float64 vector they make."""

    specs: tuple[ArraySpec, ...]

    @classmethod
    def of(cls, arrays: Mapping[str, Any]) -> ArrayLayout:
        """The layout of ``arrays`` (name -> numpy array, order kept)."""
        return cls(tuple(ArraySpec(name, tuple(int(s) for s in np.shape(value)),
                                   str(np.asarray(value).dtype))
                         for name, value in arrays.items()))

    @property
    def size(self) -> int:
        return sum(spec.size for spec in self.specs)

    def flatten(self, arrays: Mapping[str, Any]) -> F64:
        """``arrays`` in layout order as one float64 vector; :class:`LayoutError` unless they
        have the layout's names (in order) and shapes, a floating dtype and finite values."""
        names = list(arrays.keys())
        expected = [s.name for s in self.specs]
        if names != expected:
            raise LayoutError(f"the arrays are {names[:8]}; the layout expects "
                              f"{expected[:8]} (same keys, same order)")
        values = []
        for spec in self.specs:
            value = np.asarray(arrays[spec.name])
            if tuple(value.shape) != spec.shape:
                raise LayoutError(f"array {spec.name!r} has shape {tuple(value.shape)}; the "
                                  f"layout expects {spec.shape}")
            if value.dtype.kind != "f":
                raise LayoutError(f"array {spec.name!r} has dtype {value.dtype}; only "
                                  "floating arrays are averaged")
            values.append(value)
        flat = np.empty(self.size, dtype=np.float64)  # one copy, cast in place
        offset = 0
        for value in values:
            flat[offset:offset + value.size] = value.reshape(-1)
            offset += value.size
        if not np.isfinite(flat).all():
            raise LayoutError("the arrays contain NaN or inf; fix the training first")
        return flat

    def unflatten(self, vector: npt.ArrayLike) -> dict[str, npt.NDArray[Any]]:
        """Layout-ordered arrays (each cast back to its dtype) from a flat vector."""
        vec = np.asarray(vector, dtype=np.float64)
        if vec.shape != (self.size,):
            raise LayoutError(f"vector has shape {vec.shape}; this layout needs ({self.size},)")
        out: dict[str, npt.NDArray[Any]] = {}
        offset = 0
        for spec in self.specs:
            chunk = vec[offset:offset + spec.size]
            out[spec.name] = np.asarray(chunk.reshape(spec.shape), dtype=spec.dtype)
            offset += spec.size
        return out


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


def _tensors(module: torch.nn.Module, include_buffers: bool) -> list[tuple[str, torch.Tensor]]:
    import torch

    items = [(name, p.data) for name, p in module.named_parameters() if p.requires_grad]
    if include_buffers:
        # Integer buffers (BatchNorm's num_batches_tracked) are counters, not averaged.
        items += [(f"buffer:{name}", b) for name, b in module.named_buffers()
                  if torch.is_floating_point(b)]
    return items


@dataclass(frozen=True)
class ParameterLayout:
    """Names, shapes and dtypes of a module's trainable tensors, in a fixed order."""

    entries: tuple[Entry, ...]
    include_buffers: bool = False

    @classmethod
    def of(cls, module: torch.nn.Module, include_buffers: bool = False) -> ParameterLayout:
        import torch

        entries = []
        for name, t in _tensors(module, include_buffers):
            if not torch.is_floating_point(t):
                raise LayoutError(f"parameter {name} has dtype {t.dtype}; only floating-point "
                                  "tensors can be averaged")
            entries.append(Entry(name, tuple(t.shape), t.dtype))
        if not entries:
            raise LayoutError("the module has no trainable floating-point parameters")
        return cls(tuple(entries), include_buffers)

    @property
    def size(self) -> int:
        return sum(e.numel for e in self.entries)

    def arrays(self) -> ArrayLayout:
        """The :class:`ArrayLayout` of the module's tensors (dtypes by their numpy names)."""
        return ArrayLayout(tuple(ArraySpec(e.name, e.shape, str(e.dtype).removeprefix("torch."))
                                 for e in self.entries))

    def check(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """The module's tensors in layout order; raises :class:`LayoutError` on any mismatch."""
        items = _tensors(module, self.include_buffers)
        names = [n for n, _ in items]
        expected = [e.name for e in self.entries]
        if names != expected:
            missing = sorted(set(expected) - set(names))
            extra = sorted(set(names) - set(expected))
            raise LayoutError(f"module tensors differ from the layout: missing {missing}, "
                              f"unexpected {extra}" if missing or extra else
                              "module tensors are in a different order than the layout")
        for entry, (name, t) in zip(self.entries, items, strict=True):
            if tuple(t.shape) != entry.shape:
                raise LayoutError(f"{name}: shape {tuple(t.shape)}, layout has {entry.shape}")
            if t.dtype != entry.dtype:
                raise LayoutError(f"{name}: dtype {t.dtype}, layout has {entry.dtype}")
        return [t for _, t in items]

    def to_vector(self, module: torch.nn.Module) -> F64:
        """Flatten ``module`` into a float64 vector of length :attr:`size`."""
        import torch

        tensors = self.check(module)
        with torch.no_grad():
            return torch.cat([t.detach().reshape(-1).to(torch.float64).cpu()
                              for t in tensors]).numpy().copy()

    def load(self, module: torch.nn.Module, vector: npt.ArrayLike) -> None:
        """Write ``vector`` into ``module`` in place (cast back to each tensor's dtype)."""
        vec = np.asarray(vector, dtype=np.float64)
        if vec.shape != (self.size,):
            raise LayoutError(f"vector has shape {vec.shape}; this layout needs ({self.size},)")
        if not np.all(np.isfinite(vec)):
            raise LayoutError("vector contains NaN or inf; refusing to load it into the model")
        import torch

        tensors = self.check(module)
        offset = 0
        with torch.no_grad():
            for entry, t in zip(self.entries, tensors, strict=True):
                chunk = torch.from_numpy(vec[offset:offset + entry.numel].copy())
                t.copy_(chunk.reshape(entry.shape).to(dtype=t.dtype, device=t.device))
                offset += entry.numel


def model_to_vector(module: torch.nn.Module, include_buffers: bool = False) -> F64:
    """Shortcut: ``ParameterLayout.of(module).to_vector(module)``."""
    return ParameterLayout.of(module, include_buffers).to_vector(module)


def vector_to_model(module: torch.nn.Module, vector: npt.ArrayLike,
                    include_buffers: bool = False) -> None:
    """Shortcut: ``ParameterLayout.of(module).load(module, vector)``."""
    ParameterLayout.of(module, include_buffers).load(module, vector)
