"""Run README.md's `## Use` snippet (its first python block) as a user would paste it, so
the snippet cannot rot: any exception fails CI."""

import pathlib
import re
import sys

readme = pathlib.Path(__file__).resolve().parents[1] / "README.md"
section = readme.read_text().split("\n## Use\n", 1)[1]
match = re.search(r"```python\n(.*?)```", section, re.S)
if match is None:
    sys.exit("README.md: no python block under '## Use'")
exec(compile(match.group(1), f"{readme}:## Use", "exec"), {"__name__": "__main__"})
