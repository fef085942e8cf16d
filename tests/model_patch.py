"""Edit one scalar field of a flatbuffer model in place, so tests can make
precisely broken files from real ones without going through our writer."""
import struct
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = sorted(p.stem for p in FIXTURES.glob("*.tflite"))


def patch_field(data: bytearray, table, field: int, fmt: str, value) -> None:
    """Overwrite field number `field` of `table` (a generated reader object over
    `data`, e.g. tflite.Model.GetRootAs(data).Subgraphs(0)) with `value`.
    The field must be present in the file (not left at its default)."""
    offset = table._tab.Offset(4 + 2 * field)
    assert offset, f"field {field} is not stored in this table"
    struct.pack_into("<" + fmt, data, table._tab.Pos + offset, value)


def patch_vector_item(data: bytearray, table, field: int, item: int, fmt: str, value) -> None:
    """Overwrite element `item` of the scalar vector in field `field` of `table`."""
    offset = table._tab.Offset(4 + 2 * field)
    assert offset, f"field {field} is not stored in this table"
    start = table._tab.Vector(offset)
    struct.pack_into("<" + fmt, data, start + item * struct.calcsize(fmt), value)
