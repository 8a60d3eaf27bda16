"""The scripts in docs/integrations/*.md, rebuilt from their ```diff blocks: "after" (the lines
kept and added) is what a user runs with freeze, "before" (kept and removed) the stock script."""

from __future__ import annotations

import os
import re
import runpy
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "integrations"


def script(doc: str, version: str = "after", index: int = 0) -> str:
    """The ``index``-th diff block of ``docs/integrations/<doc>``, as the ``version`` script."""
    blocks = re.findall(r"```diff\n(.*?)```", (DOCS / doc).read_text(), flags=re.S)
    drop = "-" if version == "after" else "+"
    lines = []
    for line in blocks[index].splitlines():
        if line.startswith(drop):
            continue
        lines.append(line[1:] if line[:1] in (" ", "+", "-") else line)
    return "\n".join(lines) + "\n"


def load(doc: str, version: str, workdir: str, index: int = 0) -> dict:
    """Write the script under ``workdir`` and run it as a module (not as __main__): its namespace.

    The file is the calling process's own: ranks of one spawn share ``workdir``, and one rank's
    ``write_text`` (which truncates first) once left the other rank running an empty script."""
    path = Path(workdir) / f"{Path(doc).stem}_{version}_{index}_pid{os.getpid()}.py"
    path.write_text(script(doc, version, index))
    return runpy.run_path(str(path), run_name=f"doc_{Path(doc).stem}")
