"""Draw the figures of docs/: rerun the blocks that draw them (as scripts/update_docs.py
does) and copy each figure beside its page.

    python scripts/docs_figures.py
"""
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
from microtrain.files.atomic import atomic_write  # noqa: E402
from update_docs import Runner, blocks, commands_output  # noqa: E402

FIGURES = {ROOT / "docs" / "sweeps.md": ["/tmp/mt/digits_sweep.png"]}  # page: figures it draws


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        runner = Runner(Path(scratch))
        for page, figures in FIGURES.items():
            run, lines = runner.page(page), page.read_text().split("\n")
            for block in blocks(page, lines):
                if block.source == "the commands below":
                    commands_output(run, lines[block.start:block.stop])
            for figure in figures:
                drawn = Path(run.mapped(figure))
                atomic_write(page.parent / drawn.name, drawn.read_bytes())
                print(f"wrote {(page.parent / drawn.name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
