"""`trainfit serve`: how fast the page's answers come (the issue's bound: 100 ms for the analytic
estimate on 2 cores), and the README's two screenshots of the page (a config that fits, one that does
not), regenerated from the page itself in headless Chromium (Debian's chromium and chromium-driver).

    python benchmarks/serve_page.py [--repeats 20] [--shots docs]

Prints, per config, the median and worst time of a POST /api/estimate round trip over localhost:
the estimate alone (what the page asks first) and with the fewest changes that fit (asked second,
when it does not fit); then the time from a changed field to the page showing the new numbers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from _browser import chromium, wait_for  # noqa: E402
from _server import call, running  # noqa: E402

CONFIGS = {
    "tiny on CPU (the default)": {},
    "llama3-8b, 8 x H100, ZeRO-3": {"model.preset": "llama3-8b", "hardware.gpu": "H100-SXM-80GB",
                                    "hardware.num_gpus": "8", "parallel.zero_stage": "3"},
    "llama3-8b, 1 x H100 (does not fit)": {"model.preset": "llama3-8b", "hardware.gpu": "H100-SXM-80GB"},
    "llama3-70b, 64 x H100, tp 8 (does not fit)": {"model.preset": "llama3-70b", "hardware.gpu": "H100-SXM-80GB",
                                                   "hardware.num_gpus": "64", "parallel.tp": "8"},
    "mixtral-8x7b, 8 x H100 (does not fit)": {"model.preset": "mixtral-8x7b", "hardware.gpu": "H100-SXM-80GB",
                                              "hardware.num_gpus": "8"},
    "llama3.1-405b, 1024 x H100, tp 8 pp 8": {"model.preset": "llama3.1-405b", "hardware.gpu": "H100-SXM-80GB",
                                              "hardware.num_gpus": "1024", "parallel.tp": "8", "parallel.pp": "8",
                                              "parallel.sequence_parallel": "true"},
}
SHOTS = {"serve-fits.png": CONFIGS["llama3-8b, 8 x H100, ZeRO-3"],
         "serve-does-not-fit.png": CONFIGS["llama3-8b, 1 x H100 (does not fit)"]}


def timed(base: str, values: dict[str, str], fixes: bool, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        status, answer = call(base, "POST", "/api/estimate", {"values": values, "fixes": fixes})
        out.append(time.perf_counter() - start)
        assert status == 200 and "error" not in answer, answer
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--shots", metavar="DIR", help="write the README's screenshots here (e.g. docs)")
    args = parser.parse_args()
    table = Table(title="POST /api/estimate over localhost, ms (median / worst)")
    for column in ("config", "estimate", "with the fixes"):
        table.add_column(column, justify="left" if column == "config" else "right")
    with running() as base:
        for name, values in CONFIGS.items():
            timed(base, values, True, 1)  # warm: first imports
            alone = timed(base, values, False, args.repeats)
            full = timed(base, values, True, max(3, args.repeats // 4))
            table.add_row(name, *(f"{1000 * statistics.median(t):.1f} / {1000 * max(t):.1f}" for t in (alone, full)))
        Console().print(table)
        with tempfile.TemporaryDirectory() as downloads, chromium(Path(downloads)) as driver:
            driver.get(base + "/")
            wait_for(lambda: driver.execute_script("return document.body.dataset.ready"), "the page")
            times, drawn = [], []  # in the page's own clock: from the change to the new numbers drawn
            for i, values in enumerate([*CONFIGS.values()] * 2):
                before = int(driver.execute_script("return document.body.dataset.settled || 0"))
                start = driver.execute_script(
                    "state.values = {}; const t = performance.now(); setValues(arguments[0]); return t",
                    {**values, "training.seq_len": str(256 + 64 * i)})
                wait_for(lambda b=before: int(driver.execute_script("return document.body.dataset.settled || 0")) > b,
                         "the answer")
                times.append(float(driver.execute_script("return document.body.dataset.settledAt")) - start)
                drawn.append(float(driver.execute_script("return document.body.dataset.drawnAt")) - start)
            print(f"a changed config (the configs above, twice) to the page's estimate drawn: median "
                  f"{statistics.median(drawn):.0f} ms, worst {max(drawn):.0f} ms; to its fixes drawn too: median "
                  f"{statistics.median(times):.0f} ms, worst {max(times):.0f} ms")
            if args.shots:
                folder = Path(args.shots)
                folder.mkdir(parents=True, exist_ok=True)
                for file, values in SHOTS.items():
                    driver.get("about:blank")
                    driver.get(base + "/")
                    wait_for(lambda: driver.execute_script("return document.body.dataset.ready"), "the page")
                    before = int(driver.execute_script("return document.body.dataset.settled || 0"))
                    driver.execute_script("setValues(arguments[0])", values)
                    wait_for(lambda b=before: int(driver.execute_script("return document.body.dataset.settled || 0"))
                             > b and not driver.execute_script("return document.getElementById('status').textContent"),
                             "the answer")
                    driver.save_screenshot(str(folder / file))
                    print(f"wrote {folder / file}")


if __name__ == "__main__":
    main()
