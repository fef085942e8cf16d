"""The optional extras (matplotlib, Optuna, threadpoolctl, ml_dtypes) load only inside the commands
that need them: importing the CLI loads none, and the runtime's run/eval/infer load no
package beyond numpy, flatbuffers and click."""
import json
import subprocess
import sys
from pathlib import Path

from trainconf.split import split

FIXTURES = Path(__file__).parent / "fixtures"
EXTRAS = ["matplotlib", "optuna", "threadpoolctl", "ml_dtypes", "microtrain.commands.sweep",
          "microtrain.commands.plot"]
RUNTIME = {"microtrain", "numpy", "flatbuffers", "click"}


def _python(code: str, *args: str):
    """Run `code` in a fresh interpreter; its last line of output is JSON."""
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_importing_the_cli_loads_no_extra():
    loaded = _python("import json, sys, microtrain.commands.cli; "
                     f"print(json.dumps(sorted(set({EXTRAS!r}) & set(sys.modules))))")
    assert loaded == []


def test_run_eval_infer_load_only_numpy_flatbuffers_and_click(tmp_path):
    frozen = split(FIXTURES / "mlp.tflite", tmp_path).frozen
    x, y = FIXTURES / "digits_x.npy", FIXTURES / "digits_onehot.npy"
    commands = [["run", str(frozen), "--input", str(x), "--target", str(y), "--epochs", "1"],
                ["eval", str(frozen), "--input", str(x), "--target", str(y)],
                ["infer", str(frozen), "--input", str(x), "-o", str(tmp_path / "out.npy")]]
    # packages loaded at start-up (site hooks) are not the runtime's doing
    code = ("import json, sys\n"
            "def tops():\n"
            "    return {m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)\n"
            "before = tops()\n"
            "from microtrain.commands.cli import main\n"
            "main(sys.argv[1:], standalone_mode=False)\n"
            "print(json.dumps(sorted(tops() - before)))")
    for args in commands:
        loaded = _python(code, *args)
        assert set(loaded) <= RUNTIME, (args[0], loaded)
        assert {"numpy", "microtrain"} <= set(loaded)
