"""`trainfit serve` with every file it opens or lists written to a log (Python's audit hooks): run as
`python _audited_serve.py LOG serve ARGS...` by the fuzz test, which reads what the server touched.
The log's first line is the JSON list of the folders Python itself reads (its library and sys.path)."""

from __future__ import annotations

import json
import os
import sys
import tempfile


def main() -> int:
    log = open(sys.argv[1], "w", buffering=1, encoding="utf-8")  # noqa: SIM115 - open for the process's life
    roots = {os.path.realpath(p) for p in (*sys.path, sys.prefix, sys.base_prefix, sys.exec_prefix)
             if p and os.path.isdir(p) and os.path.realpath(p) != os.path.realpath(os.getcwd())}
    log.write(json.dumps(sorted(roots)) + "\n")
    tempfile.gettempdir()  # its first call writes a probe file in the temp folder: Python's, not the server's

    def hook(event: str, args: tuple) -> None:
        if event in ("open", "os.listdir", "os.scandir", "glob.glob") and args and isinstance(args[0], str | bytes):
            log.write(f"{event}\t{os.path.realpath(os.fsdecode(args[0]))}\n")

    sys.addaudithook(hook)
    from trainfit.cli import main as trainfit

    return trainfit(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
