"""Print docs/operators.md's table of supported operators from trainconf/operators.py
(scripts/update_docs.py writes it into the page; tests/test_docs.py fails while it is stale).

    python scripts/operator_table.py
"""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _mark(flag: bool) -> str:
    return "yes" if flag else ""


def _forward(op) -> str:
    if op.lowered:
        return "unrolled at split"
    if op.forward and op.versions:
        return f"yes (version {', '.join(str(v) for v in sorted(op.versions))})"
    return _mark(op.forward)


def _trains(op) -> str:
    if op.lowered:
        return "every weight, through time"
    if not op.weighted:
        return ""
    where = f"input {op.weight}" if op.kernel else "a per-feature constant operand"
    parts = [where + (f", bias input {op.bias}" if op.bias is not None else "")]
    if op.row_grad:
        parts.append("rows")
    if op.layer:
        parts.append("layer")
    return "; ".join(parts)


def table() -> str:
    """The markdown table: the registry's operators, and those that run only on
    int8 tensors (QUANTIZE, DEQUANTIZE)."""
    from microtrain.step.kernels import INTEGER_KERNELS
    from trainconf.operators import OPERATORS
    rows = ["| operator | forward | int8 (docs/quantization.md) | gradient | folded | trains "
            "(weight; rows: can train some output channels; layer: scaled per layer by "
            "`--loss-scale adaptive`) |",
            "|---|---|---|---|---|---|"]
    for name in sorted(set(OPERATORS) | set(INTEGER_KERNELS)):
        int8 = _mark(name in INTEGER_KERNELS)
        op = OPERATORS.get(name)
        rows.append(f"| {name} | | {int8} | | | |" if op is None else
                    f"| {name} | {_forward(op)} | {int8} | {_mark(op.gradient)} | "
                    f"{_mark(op.fold)} | {_trains(op)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    print(table())
