"""A small reverse-mode autograd tape (micrograd/tinygrad style) over NumPy or CuPy arrays.

``Tensor`` wraps an array; every differentiable op is a ``Function`` subclass with static
``forward(ctx, *args)`` (arrays in, array or tuple of arrays out) and ``backward(ctx, *grads)``
(one gradient per positional forward argument, ``None`` for non-tensors). How the graph keeps
arrays alive, and so what ``recompute`` saves: docs/design.md, section 4.

``Tensor``'s arithmetic (``+ - * / @``, unary ``-``, ``sum``, ``mean``, ``reshape``,
``transpose``) is ordinary methods of its class calling the Functions defined here (``Add``,
``Sub``, ``Mul``, ``Div``, ``MatMul``, ``Sum``, ``Reshape``, ``Transpose``), with broadcasting
undone in backward by :func:`unbroadcast`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import numpy as np

from cuattn._util import array_library, array_module

__all__ = [
    "Context",
    "Function",
    "Tensor",
    "is_grad_enabled",
    "no_grad",
    "recompute",
    "saved_nbytes",
    "unbroadcast",
]


class _State(threading.local):
    def __init__(self) -> None:
        self.grad_enabled = True
        self.region: _Region | None = None


_state = _State()


def is_grad_enabled() -> bool:
    """Whether ops record the graph now (False inside :func:`no_grad`; per thread).

    Returns:
        bool: True unless inside ``no_grad()``.
    """
    return _state.grad_enabled


@contextlib.contextmanager
def no_grad() -> Iterator[None]:
    """Context manager: ops inside build no graph and their outputs do not require grad.

    Yields:
        None. The previous setting is restored on leaving (per thread).
    """
    previous = _state.grad_enabled
    _state.grad_enabled = False
    try:
        yield
    finally:
        _state.grad_enabled = previous


class Context:
    """Per-call scratch space handed to a :class:`Function`'s ``forward`` and ``backward``.

    Made by :meth:`Function.apply`; a Function may set any attribute on it.

    Args:
        needs_input_grad (tuple[bool, ...]): per positional forward argument, whether a
            gradient is wanted for it.
    """

    def __init__(self, needs_input_grad: tuple[bool, ...]) -> None:
        self.needs_input_grad = needs_input_grad
        self.saved_tensors: tuple[Any, ...] = ()
        self.non_differentiable: frozenset[int] = frozenset()

    def save_for_backward(self, *arrays: Any) -> None:
        """Keep arrays for ``backward`` (as ``ctx.saved_tensors``); counted by
        :func:`saved_nbytes` and dropped by a recompute region.

        Args:
            *arrays: the arrays (or None) backward will read.
        """
        self.saved_tensors = arrays

    def mark_non_differentiable(self, *output_indices: int) -> None:
        """Mark outputs (by position) that never receive a gradient, e.g. a side output.

        Args:
            *output_indices: positions in forward's output tuple.
        """
        self.non_differentiable = frozenset(output_indices)


class _Node:
    """One recorded op call: the function, its context and where its input gradients go."""

    __slots__ = ("fn", "ctx", "edges", "out_meta", "multi", "region", "replay")

    def __init__(self, fn: type[Function], ctx: Context, edges: list, out_meta: list, multi: bool):
        self.fn = fn
        self.ctx: Context | None = ctx
        # edges[i] for positional arg i: None (no grad), a leaf Tensor, or (node, output index)
        self.edges = edges
        self.out_meta = out_meta  # [(shape, dtype)] per output, to zero-fill missing grads
        self.multi = multi
        self.region: _Region | None = None
        self.replay: tuple | None = None  # (arg sources, kwargs) when recorded inside a region


class _Region:
    """A recompute region: its nodes in forward order and the arrays it needs to re-run them."""

    def __init__(self) -> None:
        self.nodes: list[_Node] = []
        self.inputs: list[Any] | None = []  # arrays of tensors from outside the region
        # id(tensor) -> (input index, tensor); holding the tensor keeps its id from being reused
        # by a new object while the region records (temporary constants come and go).
        self._input_ids: dict[int, tuple[int, Tensor]] = {}
        self._positions: dict[int, int] = {}

    def record(self, node: _Node, args: tuple, kwargs: dict) -> None:
        sources = []
        for a in args:
            if isinstance(a, Tensor):
                if a._node is not None and a._node.region is self:
                    sources.append(("int", self._positions[id(a._node)], a._index))
                else:
                    if id(a) not in self._input_ids:
                        self._input_ids[id(a)] = (len(self.inputs), a)
                        self.inputs.append(a.data)
                    sources.append(("ext", self._input_ids[id(a)][0]))
            else:
                sources.append(("const", a))
        node.region = self
        node.replay = (sources, kwargs)
        self._positions[id(node)] = len(self.nodes)
        self.nodes.append(node)

    def close(self) -> None:
        # Ids are only needed while recording; let go of the tensors (their arrays stay in inputs).
        self._input_ids = {}
        self._positions = {}
        self.drop()

    def drop(self) -> None:
        for node in self.nodes:
            node.ctx = None

    def materialize(self) -> None:
        """Re-run the region's forward to rebuild every node's saved arrays."""
        if self.inputs is None:
            raise RuntimeError("recompute region was already freed by a backward pass")
        outputs: list[tuple] = []
        for node in self.nodes:
            sources, kwargs = node.replay
            args = []
            for src in sources:
                if src[0] == "int":
                    args.append(outputs[src[1]][src[2]])
                elif src[0] == "ext":
                    args.append(self.inputs[src[1]])
                else:
                    args.append(src[1])
            needs = tuple(e is not None for e in node.edges)
            ctx = Context(needs)
            out = node.fn.forward(ctx, *args, **kwargs)
            outputs.append(out if isinstance(out, tuple) else (out,))
            node.ctx = ctx


@contextlib.contextmanager
def recompute(enabled: bool = True) -> Iterator[None]:
    """Context manager: keep only the region's inputs; backward re-runs the region's forward,
    then its backward.

    Nested regions join the outermost one; nothing is recorded under :func:`no_grad`. The
    region's inputs must not be modified in place between forward and backward (the recomputed
    forward would see the new values).

    Args:
        enabled (bool): False makes the region an ordinary one (default True).

    Yields:
        None.

    Example:
        >>> import numpy as np, cuattn
        >>> x = cuattn.Tensor(np.ones((2, 3), np.float32), requires_grad=True)
        >>> with cuattn.recompute():
        ...     y = (x * x).sum()
        >>> y.backward()
        >>> x.grad.tolist()
        [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
    """
    if not enabled or _state.region is not None or not _state.grad_enabled:
        yield
        return
    region = _Region()
    _state.region = region
    try:
        yield
    finally:
        _state.region = None
        region.close()


class Function:
    """Base class of differentiable ops. Subclasses define static ``forward`` and ``backward``
    and are called through :meth:`apply`."""

    @staticmethod
    def forward(ctx: Context, *args: Any, **kwargs: Any) -> Any:
        """The op on arrays (a subclass defines it).

        Args:
            ctx (Context): scratch space shared with ``backward``.
            *args: the arrays (the Tensors' data) and other values ``apply`` received.
            **kwargs: keyword arguments ``apply`` received (never differentiated).

        Returns:
            An array, or a tuple of arrays.
        """
        raise NotImplementedError

    @staticmethod
    def backward(ctx: Context, *grads: Any) -> Any:
        """The gradients of the op's inputs (a subclass defines it).

        Args:
            ctx (Context): what ``forward`` kept.
            *grads: one gradient per forward output (zeros for an output that got none), each
                in that output's dtype.

        Returns:
            One gradient per positional forward argument (a tuple unless there is one), None
            where no gradient is wanted (``ctx.needs_input_grad``) or the argument is not a
            tensor; each shaped as its input.
        """
        raise NotImplementedError

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """Run the op: ``forward`` on the arrays, and a graph node when a gradient is wanted.

        Args:
            *args: Tensors (differentiated where they require grad) and other values.
            **kwargs: passed to ``forward`` as they are.

        Returns:
            A Tensor, or a tuple of Tensors as forward returns a tuple; they require grad when
            an input did (and grad is enabled), except outputs marked non-differentiable.
        """
        arrays = [a.data if isinstance(a, Tensor) else a for a in args]
        needs = tuple(isinstance(a, Tensor) and a.requires_grad for a in args)
        record = _state.grad_enabled and any(needs)
        ctx = Context(needs)
        out = cls.forward(ctx, *arrays, **kwargs)
        multi = isinstance(out, tuple)
        outs = out if multi else (out,)
        if not record:
            wrapped = tuple(Tensor(o) for o in outs)
            return wrapped if multi else wrapped[0]
        edges: list = []
        for a, need in zip(args, needs, strict=True):
            if not need:
                edges.append(None)
            elif a._node is None:
                edges.append(a)
            else:
                edges.append((a._node, a._index))
        meta = [(o.shape, o.dtype) for o in outs]
        node = _Node(cls, ctx, edges, meta, multi)
        if _state.region is not None:
            _state.region.record(node, args, kwargs)
        wrapped = []
        for i, o in enumerate(outs):
            t = Tensor(o)
            if i not in ctx.non_differentiable:
                t.requires_grad = True
                t._node, t._index = node, i
            wrapped.append(t)
        return tuple(wrapped) if multi else wrapped[0]


class Tensor:
    """An array with an optional gradient, recorded on cuattn's tape.

    The attention calls, ``split_heads`` and ``merge_heads`` take Tensors; the arithmetic
    (``+ - * / @``, unary ``-``, :meth:`sum`, :meth:`mean`, :meth:`reshape`,
    :meth:`transpose`) records on the tape. docs/frameworks.md, section "The tape
    (`cuattn.Tensor`) and recompute".

    Args:
        data (array): a NumPy or CuPy array, kept as ``.data`` (never copied); anything else
            goes through ``numpy.asarray``.
        requires_grad (bool): a leaf whose ``.grad`` backward fills (default False).

    Raises:
        TypeError: ``data`` is already a Tensor; ``requires_grad`` with a non-floating dtype.
    """

    __slots__ = ("data", "grad", "requires_grad", "_node", "_index", "__weakref__")
    __array_ufunc__ = None  # so ndarray + Tensor defers to Tensor.__radd__ (and friends)

    def __init__(self, data: Any, requires_grad: bool = False) -> None:
        if isinstance(data, Tensor):
            raise TypeError("Tensor(data): data is already a Tensor; use .detach() or .data")
        if not hasattr(data, "shape") or not hasattr(data, "dtype"):
            data = np.asarray(data)
        if requires_grad and data.dtype.kind != "f":
            raise TypeError(f"only floating tensors can require grad, got dtype {data.dtype}")
        self.data = data
        self.grad: Any = None
        self.requires_grad = bool(requires_grad)
        self._node: _Node | None = None
        self._index = 0

    # -- array-like properties ---------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The data's shape, as a tuple of ints."""
        return tuple(self.data.shape)

    @property
    def dtype(self) -> Any:
        """The data's dtype."""
        return self.data.dtype

    @property
    def ndim(self) -> int:
        """The data's number of axes."""
        return self.data.ndim

    @property
    def size(self) -> int:
        """The data's number of elements."""
        return int(self.data.size)

    @property
    def xp(self) -> ModuleType:
        """The data's array module: numpy or cupy."""
        return array_module(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype}{grad})"

    def __len__(self) -> int:
        return self.shape[0]

    def detach(self) -> Tensor:
        """A Tensor of the same array, off the tape.

        Returns:
            Tensor: sharing ``data``, not requiring grad.
        """
        return Tensor(self.data)

    def item(self) -> float:
        """The value of a one-element tensor.

        Returns:
            float: the Python scalar (as the array's ``item()``).
        """
        return self.data.item()

    def numpy(self) -> np.ndarray:
        """The data as a NumPy array (a copy from CuPy's device memory).

        Returns:
            numpy.ndarray: ``data`` itself for a NumPy tensor.
        """
        xp = self.xp
        return self.data if xp is np else xp.asnumpy(self.data)

    # -- arithmetic: the Functions at the end of this module -----------------------------------
    def __add__(self, other: Any) -> Tensor:
        return Add.apply(self, _operand(other))

    def __radd__(self, other: Any) -> Tensor:
        return Add.apply(_operand(other), self)

    def __sub__(self, other: Any) -> Tensor:
        return Sub.apply(self, _operand(other))

    def __rsub__(self, other: Any) -> Tensor:
        return Sub.apply(_operand(other), self)

    def __mul__(self, other: Any) -> Tensor:
        return Mul.apply(self, _operand(other))

    def __rmul__(self, other: Any) -> Tensor:
        return Mul.apply(_operand(other), self)

    def __truediv__(self, other: Any) -> Tensor:
        return Div.apply(self, _operand(other))

    def __neg__(self) -> Tensor:
        return Mul.apply(self, -1.0)

    def __matmul__(self, other: Any) -> Tensor:
        return MatMul.apply(self, _operand(other))

    def sum(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        """The sum over axes, differentiable.

        Args:
            axis (int | tuple[int, ...], optional): the axes; None (default): all of them.
            keepdims (bool): keep the summed axes with size 1 (default False).

        Returns:
            Tensor: the sum.
        """
        return Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        """The mean over axes, differentiable.

        Args:
            axis (int | tuple[int, ...], optional): the axes; None (default): all of them.
            keepdims (bool): keep the averaged axes with size 1 (default False).

        Returns:
            Tensor: the mean.
        """
        count = 1
        for ax in _norm_axes(axis, self.ndim):
            count *= self.shape[ax]
        return Mul.apply(Sum.apply(self, axis=axis, keepdims=keepdims), 1.0 / count)

    def reshape(self, *shape: int | tuple[int, ...] | list[int]) -> Tensor:
        """The tensor in another shape, differentiable: ``t.reshape(2, 3)`` or
        ``t.reshape((2, 3))``.

        Args:
            *shape: the new shape, as ints or one tuple/list (one -1 allowed, as NumPy's).

        Returns:
            Tensor: the reshaped tensor.
        """
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = shape[0]
        return Reshape.apply(self, tuple(shape))

    def transpose(self, *axes: int | tuple[int, ...] | list[int] | None) -> Tensor:
        """The tensor with its axes permuted, differentiable: ``t.transpose(2, 0, 1)`` or
        ``t.transpose((2, 0, 1))``.

        Args:
            *axes: the permutation, as ints or one tuple/list; none (or None) reverses the axes,
                as NumPy's.

        Returns:
            Tensor: the transposed tensor.
        """
        if len(axes) == 1 and (axes[0] is None or isinstance(axes[0], (tuple, list))):
            axes = axes[0]
        return Transpose.apply(self, tuple(axes) if axes else None)

    # -- backward ------------------------------------------------------------------------------
    def backward(self, grad: Any = None, retain_graph: bool = False) -> None:
        """Accumulate d(self)/d(leaf) * grad into every leaf's ``.grad``.

        Args:
            grad (array | Tensor, optional): the gradient of self, its shape; None (default):
                1, for a single-element tensor.
            retain_graph (bool): keep the saved arrays for another backward (default False:
                released after use; recompute regions drop their recomputed arrays again).

        Raises:
            RuntimeError: self does not require grad; the graph was freed by an earlier
                backward; a Function's backward returned the wrong number of gradients.
            ValueError: no ``grad`` for a tensor of more than one element; ``grad`` of another
                shape; a Function's backward returned a gradient of the wrong shape.
        """
        if not self.requires_grad:
            raise RuntimeError("backward() on a tensor that does not require grad")
        xp = self.xp
        if grad is None:
            if self.size != 1:
                raise ValueError(
                    f"backward() without grad needs a single-element tensor, got shape {self.shape}"
                )
            grad = xp.ones_like(self.data)
        else:
            grad = grad.data if isinstance(grad, Tensor) else grad
            if tuple(grad.shape) != self.shape:
                raise ValueError(f"grad has shape {tuple(grad.shape)}, tensor has {self.shape}")
        if self._node is None:
            _accumulate_leaf(self, grad)
            return
        order = _topo_order(self._node)
        pending: dict[int, list] = {id(self._node): [None] * len(self._node.out_meta)}
        pending[id(self._node)][self._index] = grad
        regions: dict[int, _Region] = {}
        for node in reversed(order):
            grads = pending.pop(id(node), None)
            if grads is None:
                continue
            if node.ctx is None:
                if node.region is None:
                    raise RuntimeError(
                        "graph was already freed by an earlier backward(); "
                        "pass retain_graph=True to backward through it twice"
                    )
                node.region.materialize()
                regions[id(node.region)] = node.region
            # Each output's gradient in that output's dtype (as torch's engine does): a loss that
            # mixes dtypes (a float16 output beside a float32 lse) sends float32 gradients back.
            grads = [
                _zeros(xp, shape, dtype) if g is None else g.astype(dtype, copy=False)
                for g, (shape, dtype) in zip(grads, node.out_meta, strict=True)
            ]
            in_grads = node.fn.backward(node.ctx, *grads)
            if not isinstance(in_grads, tuple):
                in_grads = (in_grads,)
            if len(in_grads) != len(node.edges):
                raise RuntimeError(
                    f"{node.fn.__name__}.backward returned {len(in_grads)} gradients "
                    f"for {len(node.edges)} forward arguments"
                )
            if not retain_graph or node.region is not None:
                node.ctx = None
            for edge, g in zip(node.edges, in_grads, strict=True):
                if edge is None or g is None:
                    continue
                if isinstance(edge, Tensor):
                    _check_shape(node, g, edge.shape)
                    _accumulate_leaf(edge, g)
                    continue
                parent, index = edge
                _check_shape(node, g, parent.out_meta[index][0])
                slot = pending.setdefault(id(parent), [None] * len(parent.out_meta))
                slot[index] = g if slot[index] is None else slot[index] + g
        for region in regions.values():
            region.drop()
            if not retain_graph:
                region.inputs = None


def _zeros(xp: ModuleType, shape: tuple, dtype: Any) -> Any:
    return xp.zeros(shape, dtype=dtype)


def _check_shape(node: _Node, grad: Any, shape: tuple) -> None:
    if tuple(grad.shape) != tuple(shape):
        raise ValueError(
            f"{node.fn.__name__}.backward produced a gradient of shape {tuple(grad.shape)} "
            f"for an input of shape {tuple(shape)}"
        )


def _accumulate_leaf(leaf: Tensor, grad: Any) -> None:
    # Never accumulate in place: a backward may hand the same array to several inputs.
    leaf.grad = grad.copy() if leaf.grad is None else leaf.grad + grad


def _topo_order(root: _Node) -> list[_Node]:
    """Nodes reachable from root, every node after all nodes it feeds from (iterative DFS)."""
    order: list[_Node] = []
    seen = {id(root)}
    stack: list[tuple[_Node, int]] = [(root, 0)]
    while stack:
        node, i = stack.pop()
        if i < len(node.edges):
            stack.append((node, i + 1))
            edge = node.edges[i]
            if isinstance(edge, tuple) and id(edge[0]) not in seen:
                seen.add(id(edge[0]))
                stack.append((edge[0], 0))
        else:
            order.append(node)
    return order


def _buffer_key(a: Any) -> tuple[int, int] | None:
    """(identity, nbytes) of the allocation an array keeps alive; views share their base's key."""
    if array_library(a) == "cupy":
        mem = a.data.mem
        return id(mem), int(mem.size)
    if isinstance(a, np.ndarray):
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        return id(root), int(root.nbytes)
    return None


def saved_nbytes(*tensors: Tensor) -> int:
    """Bytes of distinct array buffers the tape holds for backward from these tensors.

    Counts every array saved by a node's ``save_for_backward`` and every input kept by a
    recompute region, each underlying allocation once. The tensors' own data is not counted.

    Args:
        *tensors: the tensors whose graphs are counted.

    Returns:
        int: bytes.
    """
    roots = [t._node for t in tensors if t._node is not None]
    nodes: dict[int, _Node] = {}
    for root in roots:
        for node in _topo_order(root):
            nodes[id(node)] = node
    buffers: dict[int, int] = {}
    regions: dict[int, _Region] = {}
    for node in nodes.values():
        arrays: list[Any] = list(node.ctx.saved_tensors) if node.ctx is not None else []
        if node.region is not None:
            regions[id(node.region)] = node.region
            arrays += [src[1] for src in node.replay[0] if src[0] == "const"]
        for a in arrays:
            key = _buffer_key(a)
            if key is not None:
                buffers[key[0]] = key[1]
    for region in regions.values():
        for a in region.inputs or ():
            key = _buffer_key(a)
            if key is not None:
                buffers[key[0]] = key[1]
    return sum(buffers.values())


# -- the arithmetic behind Tensor's operators --------------------------------------------------


def unbroadcast(grad: Any, shape: tuple[int, ...]) -> Any:
    """Sum a broadcast gradient back down to the input's shape (for a Function's backward).

    Args:
        grad (array): the gradient of a broadcast result.
        shape (tuple[int, ...]): the input's shape, which broadcast to grad's.

    Returns:
        grad summed over the leading and the size-1 axes, reshaped to ``shape``.
    """
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    if lead > 0:
        grad = grad.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad.reshape(shape)


def _operand(x: Any) -> Any:
    """The other operand of an operator: a raw array (or list) becomes a constant Tensor, so a
    recompute region records it as an input; Tensors and Python scalars pass through."""
    if isinstance(x, (Tensor, int, float)):
        return x
    return Tensor(x)


class Add(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (np.shape(a), np.shape(b))  # a Python scalar (the 2.0 in 2.0 + t) has ()
        return a + b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        sa, sb = ctx.shapes
        ga = unbroadcast(g, sa) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(g, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class Sub(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (np.shape(a), np.shape(b))
        return a - b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        sa, sb = ctx.shapes
        ga = unbroadcast(g, sa) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(-g, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class Mul(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (np.shape(a), np.shape(b))
        # da needs b and db needs a: keep only what a requested gradient will read.
        ctx.save_for_backward(
            b if ctx.needs_input_grad[0] else None, a if ctx.needs_input_grad[1] else None
        )
        return a * b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        b, a = ctx.saved_tensors
        sa, sb = ctx.shapes
        ga = unbroadcast(g * b, sa) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(g * a, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class Div(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (np.shape(a), np.shape(b))
        out = a / b
        ctx.save_for_backward(b, out if ctx.needs_input_grad[1] else None)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        b, out = ctx.saved_tensors
        sa, sb = ctx.shapes
        ga = unbroadcast(g / b, sa) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(-g * out / b, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class MatMul(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(
                f"matmul needs inputs with ndim >= 2, got shapes {a.shape} and {b.shape}"
            )
        ctx.shapes = (a.shape, b.shape)
        ctx.save_for_backward(
            b if ctx.needs_input_grad[0] else None, a if ctx.needs_input_grad[1] else None
        )
        return a @ b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        b, a = ctx.saved_tensors
        sa, sb = ctx.shapes
        ga = unbroadcast(g @ b.swapaxes(-1, -2), sa) if ctx.needs_input_grad[0] else None
        gb = unbroadcast(a.swapaxes(-1, -2) @ g, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


def _norm_axes(axis: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted(a % ndim for a in axes))


class Sum(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, axis: Any = None, keepdims: bool = False) -> Any:
        ctx.shape = a.shape
        ctx.axes = _norm_axes(axis, a.ndim)
        ctx.keepdims = keepdims
        return a.sum(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        xp = array_module(g)
        if not ctx.keepdims:
            g = xp.expand_dims(g, ctx.axes)
        return xp.broadcast_to(g, ctx.shape).copy()


class Reshape(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, shape: tuple[int, ...]) -> Any:
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return g.reshape(ctx.shape), None


class Transpose(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, axes: tuple[int, ...] | None = None) -> Any:
        axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(axes)
        ctx.axes = axes
        return a.transpose(axes)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return g.transpose(tuple(np.argsort(ctx.axes))), None
