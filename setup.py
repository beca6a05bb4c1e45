"""Build hook: generate the contract's Python modules from protos/.

`pip install .` and `pip install -e .` both run build_py, which calls
scripts/gen_protos.py before packaging. Generated files are never edited by
hand and are not committed (.gitignore).
"""

import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        subprocess.check_call([sys.executable, str(ROOT / "scripts" / "gen_protos.py")])
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
