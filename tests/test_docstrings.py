"""Every public callable's docstring has the sections a user reads (Google style, as
FlexAttention's and FlashInfer's): a one-line summary, ``Args:`` naming exactly the parameters of
its signature in order (``self``/``cls`` aside; ``*args``/``**kwargs`` only where documented, then
spelt with their stars), and ``Returns:`` (``Yields:`` for a context manager). A constructor's
``Args:`` is in its class's docstring and compared with ``__init__``; a callable annotated
``-> None`` needs no ``Returns:``.

The public surface: ``cuattn.__all__``, the public methods of the exported classes,
``cuattn.dynamic``, the tape (``cuattn.tape``), ``cuattn.nn``, the ``cuattn.compat`` entry
points, the serving package (``KVCache``, ``decode_attention``, ``paged_decode`` and every
policy of ``cuattn.policies``, with the ``Policy`` methods the cache calls) and
``cuattn.distributed`` (``ring_attention``, ``shard`` and the rest of its ``__all__``)."""

import importlib
import importlib.util
import inspect
import re

import pytest

# (module, names): None takes the module's __all__.
SURFACE = [
    ("cuattn", None),
    ("cuattn.dynamic", None),
    ("cuattn.autograd.tape", None),
    ("cuattn.nn", None),
    ("cuattn.compat.transformers", None),
    ("cuattn.compat.hf_cache", None),
    ("cuattn.compat.deepspeed", None),
    ("cuattn.serving", None),
    ("cuattn.serving.policies", None),
    ("cuattn.distributed", None),
]
# Not checked here: the tape's module, exported by name (its callables: cuattn.autograd.tape).
SKIPPED = {"tape"}
# Modules that import torch (and transformers) when they load.
NEEDS_TORCH = ("cuattn.nn", "cuattn.compat", "cuattn.distributed")
TITLES = "Args|Arguments|Returns|Yields|Raises|Example|Examples|Attributes|Note"
SECTION = re.compile(rf"^({TITLES}):\s*$")
ENTRY = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:")


def sections(doc: str) -> dict[str, list[str]]:
    """The docstring's sections by title, each as its lines with the section's indentation
    removed (a section's entries start at column 0)."""
    found: dict[str, list[str]] = {}
    current = None
    base = None
    for line in inspect.cleandoc(doc).splitlines():
        header = SECTION.match(line)
        if header:
            current, base = header.group(1), None
            found[current] = []
            continue
        if current is None:
            continue
        if line.strip() and not line.startswith((" ", "\t")):
            current = None  # prose at the docstring's own indentation ends the section
            continue
        if base is None and line.strip():
            base = len(line) - len(line.lstrip())
        found[current].append(line[base:] if base is not None else line)
    return found


def documented_args(doc: str) -> list[str]:
    """The names an ``Args:`` section documents (its entries' first words, stars kept)."""
    names = []
    for line in sections(doc).get("Args", sections(doc).get("Arguments", [])):
        if line.strip() and not line.startswith((" ", "\t")):
            entry = ENTRY.match(line)
            if entry:
                names.append(entry.group(1))
    return names


def signature_args(fn, documented: list[str]) -> list[str]:
    """The parameter names a docstring must list: all but self/cls; *args and **kwargs only
    when the docstring lists them (with their stars)."""
    names = []
    for p in inspect.signature(fn).parameters.values():
        if p.name in ("self", "cls"):
            continue
        if p.kind is p.VAR_POSITIONAL:
            if f"*{p.name}" in documented:
                names.append(f"*{p.name}")
            continue
        if p.kind is p.VAR_KEYWORD:
            if f"**{p.name}" in documented:
                names.append(f"**{p.name}")
            continue
        names.append(p.name)
    return names


def problems(name: str, fn, doc: str | None, constructor: bool = False) -> list[str]:
    """What ``doc`` lacks for the callable ``fn`` (empty when nothing)."""
    if not doc or not doc.strip():
        return [f"{name}: no docstring"]
    found = []
    summary = inspect.cleandoc(doc).splitlines()[0].strip()
    if not summary or SECTION.match(summary):
        found.append(f"{name}: no one-line summary")
    has = sections(doc)
    documented = documented_args(doc)
    wanted = signature_args(fn, documented)
    if wanted and not ({"Args", "Arguments"} & has.keys()):
        found.append(f"{name}: no Args section for {wanted}")
    elif documented != wanted:
        found.append(f"{name}: Args documents {documented}, the signature has {wanted}")
    returns_none = inspect.signature(fn).return_annotation in (None, "None")
    if not constructor and not returns_none and not ({"Returns", "Yields"} & has.keys()):
        found.append(f"{name}: no Returns section")
    return found


def own_methods(cls):
    """(defining class's name, method name, method) of the public methods cls defines or
    inherits from cuattn's classes (``extra_repr``, torch's printing hook, aside)."""
    seen = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("cuattn"):
            continue
        for attr, value in vars(klass).items():
            if attr.startswith("_") or attr == "extra_repr" or isinstance(value, property):
                continue
            if isinstance(value, (staticmethod, classmethod)) or inspect.isfunction(value):
                seen[attr] = (klass.__qualname__, attr, getattr(cls, attr))
    return sorted(seen.values())


def public_callables(module_name: str, names: list[str] | None) -> list[tuple]:
    """(qualified name, callable, docstring, is a constructor) of every public callable of one
    module, each once (a method subclasses inherit: under the class that defines it)."""
    module = importlib.import_module(module_name)
    found = []
    for name in names or module.__all__:
        obj = getattr(module, name)
        if name in SKIPPED or inspect.ismodule(obj) or not callable(obj):
            continue
        if inspect.isclass(obj):
            found.append((f"{module_name}.{name}", obj.__init__, inspect.getdoc(obj), True))
            for owner, attr, method in own_methods(obj):
                qualified = f"{module_name}.{owner}.{attr}"
                found.append((qualified, method, inspect.getdoc(method), False))
        else:
            found.append((f"{module_name}.{name}", obj, inspect.getdoc(obj), False))
    unique = {}
    for entry in found:
        unique.setdefault(getattr(entry[1], "__func__", entry[1]), entry)
    return sorted(unique.values(), key=lambda entry: entry[0])


# Imported inside the tests, not at collection: torch and transformers load only where needed.
@pytest.mark.parametrize(("module_name", "names"), SURFACE, ids=[m for m, _ in SURFACE])
def test_public_docstrings_match_signatures(module_name, names):
    if module_name.startswith(NEEDS_TORCH):
        pytest.importorskip("torch")
        if module_name.startswith("cuattn.compat.t") or module_name.endswith("hf_cache"):
            pytest.importorskip("transformers")
    found = [
        problem
        for name, fn, doc, constructor in public_callables(module_name, names)
        for problem in problems(name, fn, doc, constructor)
    ]
    assert not found, "\n".join(found)


def test_public_properties_have_a_docstring():
    missing = []
    for module_name, names in SURFACE:
        if module_name.startswith(("cuattn.nn", "cuattn.compat")):
            continue  # their classes' properties are torch's and transformers'
        if module_name.startswith(NEEDS_TORCH) and importlib.util.find_spec("torch") is None:
            continue
        module = importlib.import_module(module_name)
        for name in names or module.__all__:
            obj = getattr(module, name)
            if name in SKIPPED or not inspect.isclass(obj):
                continue
            for klass in obj.__mro__:
                if not klass.__module__.startswith("cuattn"):
                    continue
                for attr, value in vars(klass).items():
                    if isinstance(value, property) and not attr.startswith("_"):
                        if not (inspect.getdoc(getattr(obj, attr, value)) or "").strip():
                            missing.append(f"{module_name}.{klass.__qualname__}.{attr}")
    assert not missing, missing


def test_the_surface_is_found():
    names = {entry[0] for entry in public_callables("cuattn", None)}
    for module_name in ("cuattn.dynamic", "cuattn.serving.policies"):
        names |= {entry[0] for entry in public_callables(module_name, None)}
    for expected in (
        "cuattn.sparse_attention",
        "cuattn.Layout",
        "cuattn.Layout.from_blocks",
        "cuattn.Pattern.layout",
        "cuattn.scaled_dot_product_attention",
        "cuattn.Tensor.backward",
        "cuattn.Function.apply",
        "cuattn.dynamic.topk_blocks",
        "cuattn.KVCache",
        "cuattn.KVCache.append",
        "cuattn.decode_attention",
        "cuattn.paged_decode",
        "cuattn.serving.policies.SnapKV",
        "cuattn.serving.policies.Policy.keep",
        "cuattn.serving.policies.pyramid",
    ):
        assert expected in names
    if importlib.util.find_spec("torch") is not None:
        names = {entry[0] for entry in public_callables("cuattn.distributed", None)}
        assert {"cuattn.distributed.ring_attention", "cuattn.distributed.shard"} <= names


def test_an_undocumented_parameter_is_found():
    def documented(q, k, scale=None):
        """Attend.

        Args:
            q (array): queries.
            k (array): keys.

        Returns:
            The output.
        """

    def renamed(q, key):
        """Attend.

        Args:
            q: queries.
            k: keys.
        """

    found = problems("documented", documented, documented.__doc__)
    assert found == ["documented: Args documents ['q', 'k'], the signature has ['q', 'k', 'scale']"]
    found = problems("renamed", renamed, renamed.__doc__)
    assert "documented: Args" not in found and len(found) == 2  # the names, and no Returns


def test_continuation_lines_are_not_parameters():
    def fn(layout, scale=None):
        """Attend.

        Args:
            layout (Layout): which blocks. A longer description that wraps onto
                a second line: starting with words: such as these.
            scale (float, optional): 1/sqrt(head_dim) by default.

        Returns:
            out: the output.
        """

    assert documented_args(fn.__doc__) == ["layout", "scale"]
    assert problems("fn", fn, fn.__doc__) == []


# Modules whose public docstrings hold ``Example:`` sections.
EXAMPLE_MODULES = [
    "cuattn.api",
    "cuattn.autograd.tape",
    "cuattn.compat.hf_cache",
    "cuattn.layout.layout",
    "cuattn.layout.pattern",
    "cuattn.layout.registry",
    "cuattn.nn",
    "cuattn.sdpa",
    "cuattn.serving.cache",
    "cuattn.serving.decode",
]


@pytest.mark.parametrize("module_name", EXAMPLE_MODULES)
def test_docstring_examples_run(module_name):
    """The ``Example:`` sections run as written (doctest), so they cannot drift from the API."""
    import doctest

    try:
        module = importlib.import_module(module_name)
    except ImportError:
        pytest.skip(f"{module_name} needs a framework that is not installed")
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
