"""`trainfit serve`: the web page of estimate and plan, on localhost unless told otherwise."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainfit.config import ConfigError


def cmd_serve(args: argparse.Namespace, overrides: list[str]) -> int:
    from trainfit.config.dump import dump_toml
    from trainfit.configure import config_of_raw, read_raw
    from trainfit.serve.server import make_server

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: a TCP port, 0-65535 (0: any free one); try --port 8000")
    raw = read_raw(args.config, overrides)
    config_of_raw(raw)  # a bad start is said here, not on the page
    start = Path(args.config).read_text(encoding="utf-8") if args.config and not overrides else dump_toml(raw)
    try:
        server = make_server(args.host, args.port, start)
    except OSError as err:
        raise ConfigError(f"--port {args.port}: cannot listen on {args.host}:{args.port} ({err.strerror}); pick "
                          "another with --port, or --port 0 for any free one") from None
    host, port = server.server_address[:2]
    print(f"trainfit serve: http://{'localhost' if host in ('127.0.0.1', '::1') else host}:{port}/ "
          "(Ctrl-C stops it)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
