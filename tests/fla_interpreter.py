"""fla's Triton kernels on a CPU, under Triton's interpreter (tests only).

fla's autotuned kernels read one pinned config each (gpu_kernels/kda/fla_configs/, set by tests/conftest.py), and
four gaps of Triton 3.x's interpreter that fla's kernels meet are shimmed here, each the interpreter's own
behaviour where compiled Triton's differs:

- a loop variable of `range` is an int in the interpreter, a tensor in compiled code (fla calls `i_t.to(...)`):
  the loop variable is made a tensor as the interpreter's assignments already are;
- `gather = tl.gather`, fla's module-level alias, escapes the interpreter's patching of `tl`: it is pointed back
  at `tl.gather`, looked up when called;
- the `bf16x3` dot precision (three bf16 products standing for one fp32 one) is refused: the interpreter
  multiplies in fp32 whatever the precision, which is what bf16x3 approximates;
- bf16 values are stored as raw uint16 bits, on which arithmetic, unary functions and dots compute garbage:
  they compute on the decoded fp32 values, and results that are bf16 are encoded back (rounding to nearest even).

Each shim skips the test that asks for it, naming the internal it looks for, when that internal is absent (a
Triton that no longer needs or allows it). install() is idempotent.
"""

import ast
import dataclasses
import sys

import numpy as np
import pytest

_COMPARISONS = {np.less, np.less_equal, np.greater, np.greater_equal, np.equal, np.not_equal}
_installed = False


def _internal(owner: object, name: str) -> object:
    if not hasattr(owner, name):
        pytest.skip(f"fla under Triton's interpreter: {getattr(owner, '__name__', owner)!s}.{name} is gone; the "
                    "shims in tests/fla_interpreter.py need a look")
    return getattr(owner, name)


def _loop_variables_as_tensors(interpreter) -> None:
    transformer = _internal(interpreter, "ASTTransformer")
    assign = _internal(transformer, "visit_Assign")

    def visit_For(self, node):
        node = self.generic_visit(node)
        call = node.iter
        func = call.func if isinstance(call, ast.Call) else None
        if getattr(func, "id", getattr(func, "attr", None)) == "range" and isinstance(node.target, ast.Name):
            # `i = i` at the top of the body, wrapped as the interpreter wraps every assignment: a tensor
            copy = ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                              value=ast.Name(id=node.target.id, ctx=ast.Load()))
            node.body.insert(0, assign(self, copy))
        return node

    transformer.visit_For = visit_For


def _gather_alias(tl) -> None:
    import fla.ops.kda.chunk_bwd
    import fla.ops.kda.chunk_fwd  # noqa: F401  (every module of the KDA path, imported)

    for module in [m for name, m in sys.modules.items() if name.startswith("fla.") and m is not None]:
        if getattr(module, "gather", None) is tl.gather:
            module.gather = lambda src, index, axis, **_: tl.gather(src, index, axis)


def _bf16x3_dots(interpreter) -> None:
    builder = _internal(interpreter, "interpreter_builder")
    allowed = _internal(builder.options, "allowed_dot_input_precisions")
    builder.options = dataclasses.replace(builder.options, allowed_dot_input_precisions=(*allowed, "bf16x3"))


def _bf16_on_decoded_values(interpreter, tl) -> None:
    builder = _internal(interpreter, "InterpreterBuilder")
    convert, handle = _internal(interpreter, "_convert_float"), _internal(interpreter, "TensorHandle")
    binary, unary, dot = (_internal(builder, name) for name in ("binary_op", "unary_op", "create_dot"))

    def is_bf16(h) -> bool:
        return h.dtype.scalar == tl.bfloat16 and h.data.dtype == np.uint16

    def decoded(h):
        return handle(convert(h.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32) if is_bf16(h) else h

    def encoded(h):
        return handle(convert(h.data.astype(np.float32), tl.float32, tl.bfloat16, None).view(np.uint16), tl.bfloat16)

    def binary_op(self, lhs, rhs, op):
        if not (is_bf16(lhs) or is_bf16(rhs)):
            return binary(self, lhs, rhs, op)
        out = binary(self, decoded(lhs), decoded(rhs), op)
        return out if op in _COMPARISONS or lhs.dtype.scalar != tl.bfloat16 else encoded(out)

    def unary_op(self, arg, op):
        return encoded(unary(self, decoded(arg), op)) if is_bf16(arg) else unary(self, arg, op)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, decoded(a), decoded(b), d, input_precision, max_num_imprecise_acc)

    builder.binary_op, builder.unary_op, builder.create_dot = binary_op, unary_op, create_dot


def install() -> None:
    """Make fla's chunk KDA kernels run on CPU tensors (TRITON_INTERPRET=1, the pinned configs): the four shims."""
    global _installed
    if _installed:
        return
    pytest.importorskip("fla")
    triton = pytest.importorskip("triton")
    from triton.runtime import interpreter

    tl = triton.language
    _loop_variables_as_tensors(interpreter)
    _gather_alias(tl)
    _bf16x3_dots(interpreter)
    _bf16_on_decoded_values(interpreter, tl)
    _installed = True
