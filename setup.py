"""Everything is in pyproject.toml but one step: the wheel carries ``optstate_hf_names.pth`` at its root,
so installing it puts the file into site-packages, where Python runs its line at every interpreter
start (see integrations/optstate_hf_names/__init__.py). An editable install does not get it that way:
``python -m optstate_hf_names install`` after ``pip install -e`` (quickstart.py runs it)."""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = os.path.join("integrations", "optstate_hf_names", "optstate_hf_names.pth")


class BuildPyWithPth(build_py):
    def _pth_target(self):
        return os.path.join(self.build_lib, os.path.basename(PTH))

    def run(self):
        super().run()
        self.copy_file(PTH, self._pth_target(), preserve_mode=False)

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [self._pth_target()]

    def get_output_mapping(self):
        return {**super().get_output_mapping(), self._pth_target(): PTH}


setup(cmdclass={"build_py": BuildPyWithPth})
