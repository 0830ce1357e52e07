"""`trainfit serve`: the web page of estimate and plan, on localhost unless told otherwise."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainfit.config import ConfigError


def cmd_serve(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.config.dump import dump_toml
    from trainfit.configure import config_of_raw, read_raw
    from trainfit.serve.guard import is_loopback
    from trainfit.serve.server import make_server

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port, 0-65535 (0: any free one); try --port 8000")
    raw = read_raw(args.config, overrides)
    config_of_raw(raw)  # a bad start is said here, not on the page
    start = Path(args.config).read_text(encoding="utf-8") if args.config and not overrides else dump_toml(raw)
    try:
        server = make_server(args.host, args.port, start, files=tuple(args.files), start_raw=raw)
    except OSError as err:
        raise ConfigError(f"--port {args.port}: cannot listen on {args.host}:{args.port} ({err.strerror}); pick "
                          "another with --port, or --port 0 for any free one") from None
    host, port = server.server_address[:2]
    if not is_loopback(args.host):
        print(exposure_warning(args.host, port, args.config, args.files), file=sys.stderr, flush=True)
    shown = "localhost" if is_loopback(host) else f"[{host}]" if ":" in host else host
    print(f"trainfit serve: http://{shown}:{port}/ (Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def exposure_warning(host: str, port: int, config: str | None, files: list[str]) -> str:
    """What a server bound beyond loopback serves, and to whom."""
    everyone = "every address of this machine" if host in ("", "0.0.0.0", "::") else host
    shared = ", ".join(repr(str(Path(f).resolve())) for f in files) if files else "none (requests name no files)"
    return (f"warning: --host {host}: listening on {everyone}, port {port}, with no login: anyone who can reach it "
            f"can run estimates and plans on this machine's CPU, read the start config ({config or 'the defaults'}), "
            f"and have the server read the config.json files, weights folders and profiles under --files: {shared}. "
            "Serve only on a network you trust, or keep the default --host 127.0.0.1 and reach it through "
            "`ssh -L PORT:localhost:PORT`.")
