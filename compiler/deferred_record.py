"""Record what building a model on `meta` does, so each initial value can be replayed alone.

`record_build` (compiler/deferred_init.py) runs `build_model()` under `torch.device("meta")`
inside `recording(recorder)`, which installs three hooks:

1. **Ops** (`Recorder`, a TorchDispatchMode): every aten op that creates or writes a meta
   storage becomes a `Step`: the op, its arguments with each meta tensor replaced by a
   `TensorRef` (a storage key and the view's size, stride, offset and dtype) and each
   real tensor by a `Const` (its value then), and the storages it creates, writes, reads
   and overwrites whole. Views and shape queries are no steps: a later step names a view
   by its geometry. Ops on real tensors only run as they are.
2. **Random ops** (tag `nondeterministic_seeded`): before the meta op, the generator's
   state is saved in the step and the op runs once on CPU scratch tensors of the same
   geometry (an input whose values it reads is first computed by `resolve`), so the
   generator advances exactly as in a real build and the code after it sees the same
   stream.
3. **torch.nn.init**: its public initialisers skip meta tensors, and some draw until a
   data-dependent test passes (trunc_normal_), so each call on a meta tensor is one
   step that runs the whole initialiser: on a scratch tensor now (the generator
   advances), on the real tensor at replay.
4. **Data constructors** (`torch.tensor`, `as_tensor`, `asarray`, `new_tensor`) make a
   meta tensor without an op: they run on the CPU and the value is copied to meta (a
   recorded copy of a `Const`).
5. What cannot be replayed raises `Unreplayable` at the op (a `Problem`): reading a
   value (`.item()`, a data-dependent `if`), an op without a meta kernel, a meta
   storage passed to an op, a second meta tensor given to an initialiser.

The values a recording holds (`Step`, `TensorRef`, `Recording`, `Problem`, ...) are in
compiler/deferred_steps.py, re-exported here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from parc.errors import clip

from .deferred_steps import (
    Const,
    GeneratorSlot,
    Problem,
    Recording,
    Rng,
    Step,
    TensorRef,
    Unreplayable,
    ref_of,
)
from .freed_memory import release_freed
from .init_tables import import_library_tables, probes_answer_cpu, replaced_everywhere

__all__ = [
    "Const",
    "GeneratorSlot",
    "Problem",
    "Recorder",
    "Recording",
    "Rng",
    "Step",
    "TensorRef",
    "Unreplayable",
    "recording",
    "ref_of",
]

aten = torch.ops.aten

# Ops whose output holds no values yet: a parameter made by one and never written has
# no initial value (an initialiser that skipped the meta tensor, e.g. imported by name).
_BLANK_OPS = frozenset(
    {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided}
)
# In-place ops that write every element of `self` without reading it: the storage's
# earlier content is dead when the write covers it whole.
_OVERWRITE_OPS = frozenset({
    aten.copy_, aten.fill_, aten.zero_, aten.normal_, aten.uniform_, aten.bernoulli_,
    aten.random_, aten.exponential_, aten.geometric_, aten.cauchy_, aten.log_normal_,
})  # fmt: skip
# Constructors that turn Python data into a tensor without dispatching an op.
_DATA_CONSTRUCTORS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})
_DATA_METHODS = frozenset({torch.Tensor.new_tensor})
# torch.nn.init's public in-place initialisers (`normal_`, `trunc_normal_`, ...).
INITIALISERS = tuple(n for n in dir(torch.nn.init) if n.endswith("_") and not n.startswith("_"))


def _is_meta(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.is_meta


def _covers_storage(t: torch.Tensor) -> bool:
    """Whether writing every element of `t` writes every byte of its storage."""
    nbytes = t.untyped_storage().nbytes()
    return t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == nbytes


def _scratch(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised CPU tensor of `t`'s size, stride and dtype."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")


def _generator_in(tree: Any) -> torch.Generator | None:
    return next((x for x in tree_flatten(tree)[0] if isinstance(x, torch.Generator)), None)


def _written(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors `func` writes in place, from its schema's `(a!)` annotations."""
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return out


class Recorder(TorchDispatchMode):
    """Records the steps of a build on meta (steps 1 and 2 of the module docstring).

    `resolve(recording, ref)` computes a recorded tensor's value so far: a random op
    whose draws depend on an input's values (bernoulli_ with a tensor p) needs it.
    """

    def __init__(self, resolve: Callable[[Recording, TensorRef], torch.Tensor]) -> None:
        super().__init__()
        self._resolve = resolve
        self.steps: list[Step] = []
        self._keys: dict[int, int] = {}
        self._nbytes: dict[int, int] = {}
        self._alive: list[torch.UntypedStorage] = []

    def so_far(self) -> Recording:
        return Recording(tuple(self.steps), self._nbytes, self._keys, tuple(self._alive))

    def knows(self, t: torch.Tensor) -> bool:
        return t.untyped_storage()._cdata in self._keys

    def key(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        key = self._keys.get(storage._cdata)
        if key is None:
            key = self._keys[storage._cdata] = len(self._keys)
            self._nbytes[key] = storage.nbytes()
            self._alive.append(storage)  # meta storages cost nothing; their addresses stay unique
        return key

    def template(self, tree: Any) -> Any:
        """`tree` with meta tensors as TensorRefs, real tensors as Consts, generators as slots."""

        def leaf(x: Any) -> Any:
            if _is_meta(x):
                return ref_of(x, self.key(x))
            if isinstance(x, torch.Tensor):
                return Const(x.detach().clone())
            if isinstance(x, torch.Generator):
                return GeneratorSlot.OWN
            if isinstance(x, torch.UntypedStorage) and x.device.type == "meta":
                raise Unreplayable(Problem.META_STORAGE, "a storage argument")
            return x

        return tree_map(leaf, tree)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not _touches_meta((args, kwargs)):
            return func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            raise Unreplayable(Problem.READS_VALUE, str(func))
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        rng = self._advance(func, args, kwargs) if seeded else None
        try:
            out = func(*args, **kwargs)
        except Exception as exc:
            raise _why(func, args, kwargs, exc) from exc
        if seeded:  # its scratch draw is freed: glibc keeps the pages otherwise
            release_freed(_meta_bytes((args, kwargs, out)))
        self._note(func, args, kwargs, out, rng)
        return out

    def _advance(self, func: Any, args: Any, kwargs: Any) -> Rng:
        """Step 2: save the generator's state, then draw once on CPU scratch tensors."""
        generator = _generator_in((args, kwargs))
        before = (generator or torch.default_generator).get_state()
        written = {id(t) for t in _written(func, args, kwargs)}
        geometry_only = func.overloadpacket.__name__.endswith("_like")

        def real(x: Any) -> Any:
            if _is_meta(x):
                if id(x) in written or geometry_only:
                    return _scratch(x)
                return self._resolve(self.so_far(), ref_of(x, self.key(x)))
            return torch.device("cpu") if _is_meta_device(x) else x

        cpu_args, cpu_kwargs = tree_map(real, (args, kwargs))
        func(*cpu_args, **cpu_kwargs)
        return Rng(before, own=generator is not None)

    def _note(self, func: Any, args: Any, kwargs: Any, out: Any, rng: Rng | None) -> None:
        """Step 1: the op as a Step, if it creates or writes a meta storage."""
        written = [t for t in _written(func, args, kwargs) if t.is_meta]
        flat_out = tree_flatten(out)[0]
        fresh = [(i, t) for i, t in enumerate(flat_out) if _is_meta(t) and not self.knows(t)]
        if not written and not fresh:
            return
        whole = func.overloadpacket in _OVERWRITE_OPS and _covers_storage(args[0])
        overwrites = frozenset({self.key(args[0])}) if whole else frozenset()
        reads = {self.key(t) for t in tree_flatten((args, kwargs))[0] if _is_meta(t)}
        self._append(
            func, args, kwargs, name=str(func), rng=rng,
            creates=tuple((i, ref_of(t, self.key(t))) for i, t in fresh),
            writes=frozenset(self.key(t) for t in written),
            reads=frozenset(reads) - overwrites, overwrites=overwrites,
            blank=func.overloadpacket in _BLANK_OPS,
        )  # fmt: skip

    def _append(self, call: Callable[..., Any], args: Any, kwargs: Any, **fields: Any) -> None:
        template = self.template((tuple(args), dict(kwargs)))
        fields["made"] = frozenset(ref.storage for _, ref in fields["creates"])
        fields["touched"] = fields["made"] | fields["writes"]
        self.steps.append(Step(call, *template, **fields))

    def record_init(self, init: Callable[..., Any], args: tuple[Any, ...], kwargs: Any) -> Any:
        """Step 3: one torch.nn.init call on a meta tensor, run whole on a scratch tensor."""
        tensor = args[0] if args else kwargs["tensor"]
        if sum(_is_meta(x) for x in tree_flatten((args, kwargs))[0]) > 1:
            raise Unreplayable(Problem.INIT_ARGUMENT, f"torch.nn.init.{init.__name__}")
        generator = _generator_in((args, kwargs))
        source = generator or torch.default_generator
        before = source.get_state()
        _init_on_scratch(init, tensor, args, kwargs)
        release_freed(_meta_bytes(tensor))  # the scratch is freed: glibc keeps the pages
        drew = not torch.equal(before, source.get_state())
        key = self.key(tensor)
        whole = frozenset({key}) if _covers_storage(tensor) else frozenset()
        self._append(
            init, args, kwargs, name=f"torch.nn.init.{init.__name__}", creates=(),
            rng=Rng(before, own=generator is not None) if drew else None,
            writes=frozenset({key}), reads=frozenset({key}) - whole, overwrites=whole,
            blank=False,
        )  # fmt: skip
        return tensor


def _init_on_scratch(
    init: Callable[..., Any], tensor: torch.Tensor, args: tuple[Any, ...], kwargs: Any
) -> None:
    """Run `init` on a CPU scratch tensor in place of the meta `tensor` (the draws only)."""
    scratch = _scratch(tensor)
    cpu_args, cpu_kwargs = tree_map(
        lambda x: scratch if x is tensor else x, (tuple(args), dict(kwargs))
    )
    with torch.device("cpu"):  # factories inside it (eye_'s torch.eye) make CPU tensors
        init(*cpu_args, **cpu_kwargs)


def _why(func: Any, args: Any, kwargs: Any, exc: Exception) -> Unreplayable:
    """Why a meta op failed: it copies values out, it has no meta kernel, or else."""
    devices = [x for x in tree_flatten(kwargs)[0] if isinstance(x, torch.device)]
    real_dst = [t for t in _written(func, args, kwargs) if not t.is_meta]
    if real_dst or any(d.type != "meta" for d in devices):
        return Unreplayable(Problem.READS_VALUE, str(func))
    if isinstance(exc, NotImplementedError):
        return Unreplayable(Problem.NO_META_KERNEL, str(func))
    return Unreplayable(Problem.FAILS_ON_META, str(func), clip(str(exc).strip(), 120))


def _meta_bytes(tree: Any) -> int:
    """Bytes of the meta tensors in `tree`: what their CPU scratch tensors took."""
    return sum(t.numel() * t.element_size() for t in tree_flatten(tree)[0] if _is_meta(t))


def _is_meta_device(x: object) -> bool:
    return isinstance(x, torch.device) and x.type == "meta"


def _touches_meta(tree: Any) -> bool:
    return any(_is_meta(x) or _is_meta_device(x) for x in tree_flatten(tree)[0])


class _DataConstructors(TorchFunctionMode):
    """Step 4: a meta tensor made from Python data is made on the CPU and copied to meta."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _DATA_CONSTRUCTORS and func not in _DATA_METHODS:
            return out
        if not _is_meta(out) or self._recorder.knows(out):
            return out
        value = func(*args, **{**kwargs, "device": "cpu"})
        meta = value.detach().to("meta")  # a recorded _to_copy of the value
        return meta.requires_grad_(value.requires_grad)


def _import_init_users() -> None:
    """Import what the first torch.nn.init call imports, before its functions are patched.

    That call imports torch._dynamo, and with it torch.distributed's sharded_tensor,
    which keeps torch.nn.init's functions in a table of its own: imported while they
    are patched, it would keep this recording's wrappers, and the recording with its
    generator states, alive for good (and record into it later).
    """
    import torch._dynamo  # noqa: F401


@contextlib.contextmanager
def _initialisers_recorded(recorder: Recorder) -> Iterator[None]:
    """Step 3: torch.nn.init's initialisers record a call on a meta tensor as one step."""
    _import_init_users()
    originals = {name: getattr(torch.nn.init, name) for name in INITIALISERS}

    def recorded(init: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args else kwargs.get("tensor")
            if not _is_meta(tensor):
                return init(*args, **kwargs)
            return recorder.record_init(init, args, kwargs)

        call.__wrapped__ = init  # type: ignore[attr-defined]
        return call

    # torch.nn.init's own namespace is one of the dicts that hold them.
    with replaced_everywhere({init: recorded(init) for init in originals.values()}):
        yield


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[None]:
    """Every hook of the module docstring, for a build under `torch.device("meta")`."""
    import_library_tables()
    hooks = (probes_answer_cpu(), _initialisers_recorded(recorder), _DataConstructors(recorder))
    with hooks[0], hooks[1], hooks[2], recorder:
        yield
