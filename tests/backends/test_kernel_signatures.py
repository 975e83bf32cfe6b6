"""geometry.KERNEL_ARGS against the kernels' own signatures: every ``__global__`` function in
kernels/*.cu is parsed, and its parameters' names and kinds must be KERNEL_ARGS's, in order.
The launches pack arguments by KERNEL_ARGS alone, so two swapped ints there would reach the
kernel in each other's place with nothing else to notice."""

import re

import pytest

from cuattn.backends import geometry
from cuattn.backends.toolchain import kernel_dir

# KERNEL_ARGS's kind of each C++ parameter type (qualifiers and __restrict__ removed)
SCALAR_KINDS = {"int": "i32", "long long": "i64", "float": "f32", "double": "f64"}
TENSOR_MAP_TYPE = "TensorMap"
# The layout arguments are named once in KERNEL_ARGS and walk CSR rows (forward, dQ) or CSC
# columns (dK/dV) in the kernels.
LAYOUT_NAMES = {
    "ptr": ("row_ptr", "col_ptr"),
    "idx": ("col_idx", "row_idx"),
    "mask": ("row_mask", "col_mask"),
}
LAUNCH_BOUNDS = r"__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)\s*"
GLOBAL = re.compile(rf"__global__\s+void\s+(?:{LAUNCH_BOUNDS})?(\w+)\s*\(")
QUALIFIERS = ("const", "__restrict__", "__grid_constant__")


DEFINE = re.compile(r"^#define\s+(\w+)[ \t]+((?:[^\n]*\\\n)*[^\n]*)", re.M)


def expand_macros(text: str) -> str:
    """``text`` with the object-like macros it defines expanded (a parameter list a kernel
    takes as one macro is read as the parameters it stands for)."""
    for name, body in DEFINE.findall(text):
        flat = body.replace("\\\n", " ")
        text = re.sub(rf"\b{name}\b(?!\s*\()", lambda _, flat=flat: flat, text)
    return text


def kernel_signatures() -> dict[str, list[tuple[str, str]]]:
    """{kernel name: [(parameter name, C++ type)]} of every __global__ function in kernels/."""
    found = {}
    for path in sorted(kernel_dir().glob("*.cu")):
        text = expand_macros(re.sub(r"//[^\n]*", "", path.read_text()))
        for match in GLOBAL.finditer(text):
            depth, end = 1, match.end()
            while depth:
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                end += 1
            params = []
            for param in text[match.end() : end - 1].split(","):
                words = param.replace("*", " * ").split()
                words = [w for w in words if w not in QUALIFIERS]
                params.append((words[-1], " ".join(words[:-1])))
            assert match.group(1) not in found, f"two __global__ {match.group(1)} in kernels/"
            found[match.group(1)] = params
    return found


def kind_of(cxx_type: str) -> str:
    if cxx_type.endswith("*"):
        return "ptr"
    if cxx_type == TENSOR_MAP_TYPE:
        return "tmap"
    return SCALAR_KINDS.get(cxx_type, cxx_type)


def names_for(name: str, kind: str) -> tuple[str, ...]:
    if kind == "tmap":
        return (f"{name}_map",)
    return LAYOUT_NAMES.get(name, (name,))


SIGNATURES = kernel_signatures()


def test_every_kernel_has_its_arguments_listed():
    assert sorted(SIGNATURES) == sorted(geometry.KERNEL_ARGS)


@pytest.mark.parametrize("kernel", sorted(geometry.KERNEL_ARGS))
def test_kernel_args_match_the_signature(kernel):
    params = SIGNATURES[kernel]
    listed = geometry.KERNEL_ARGS[kernel]
    assert len(params) == len(listed), (kernel, [p for p, _ in params], [a for a, _ in listed])
    for i, ((param, cxx_type), (arg, kind)) in enumerate(zip(params, listed, strict=True)):
        assert kind_of(cxx_type) == kind, f"{kernel} argument {i} {param}: {cxx_type} is not {kind}"
        assert param in names_for(arg, kind), f"{kernel} argument {i} is {param}, listed as {arg}"


def test_a_swapped_pair_is_caught():
    """The check itself: two ints of attn_fwd swapped in the listing no longer match."""
    listed = list(geometry.KERNEL_ARGS["attn_fwd"])
    i, j = listed.index(("n_q", "i32")), listed.index(("n_k", "i32"))
    listed[i], listed[j] = listed[j], listed[i]
    params = SIGNATURES["attn_fwd"]
    assert any(p not in names_for(a, k) for (p, _), (a, k) in zip(params, listed, strict=True))
