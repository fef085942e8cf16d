"""What `trainconf split` refuses before it plans memory or writes a file: an
operator it would run that microtrain cannot run (no forward kernel), or whose
options name a value the schema does not have.  Operators on the gradient path
without a gradient rule are refused by the backprop builder, before planning
too; ops below the lowest trained layer need only their forward kernel."""
from microtrain.files.errors import UserError
from microtrain.files.format import circle_generated as circle
from microtrain.files.format.model import enum_names
from microtrain.files.graph import Graph, Op
from microtrain.step.kernels import version_problem

from .operators import OPERATORS, spec

# enum-valued options and the values the schema gives them
ENUM_OPTIONS = {"padding": enum_names(circle.Padding),
                "fused_activation_function": enum_names(circle.ActivationFunctionType)}


def check_forward(g: Graph) -> None:
    """One line naming the first operator microtrain cannot run."""
    for op in g.ops:
        if not spec(op.type).forward:
            raise UserError(None, f"operator {op.index} ({op.type}) {_why(op)}")
        if problem := version_problem(op.type, op.version):
            raise UserError(None, f"operator {op.index} ({op.type}) {problem}")
        for key, names in ENUM_OPTIONS.items():
            value = op.options.get(key)
            if value is not None and value not in names:
                raise UserError(None, f"operator {op.index} ({op.type}) has {key} {value}, "
                                      f"which is none of {', '.join(names.values())}")


def _why(op: Op) -> str:
    if hasattr(circle.BuiltinOperator, op.type):
        return "has no forward kernel in microtrain (see docs/operators.md)"
    known = sorted(n for n, o in OPERATORS.items()
                   if o.forward and not hasattr(circle.BuiltinOperator, n))
    return ("is a custom operator microtrain has no kernel for"
            + (f" (custom operators it runs: {', '.join(known)})" if known else ""))
