"""The documentation: the site (mkdocs.yml, docs/) builds strictly (a broken link, a missing page or a
failing generated part fails it) and loads nothing from the network; its config and JSON references
are complete; README stays short and its links lead somewhere; every shell block marked runnable in
README and docs runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
RUNNABLE = re.compile(r"^<!-- runnable -->\n```bash\n(.*?)^```", re.MULTILINE | re.DOTALL)
EXTERNAL = re.compile(r"""<(?:script|link|img|iframe|source|embed|object|audio|video)\b[^>]*?"""
                      r"""\b(?:src|href|data)\s*=\s*["']?(?:https?:)?//""", re.IGNORECASE)
CSS_EXTERNAL = re.compile(r"""(?:url\(\s*["']?|@import\s+["'])(?:https?:)?//""", re.IGNORECASE)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_the_site_builds_strictly_and_loads_nothing_from_the_network(site) -> None:
    pages = list(site.rglob("*.html"))
    assert len(pages) >= 25
    found = [f"{page.relative_to(site)}: {m.group(0)[:120]}" for page in pages
             for m in EXTERNAL.finditer(page.read_text(encoding="utf-8"))]
    found += [f"{css.relative_to(site)}: {m.group(0)}" for css in site.rglob("*.css")
              for m in CSS_EXTERNAL.finditer(css.read_text(encoding="utf-8", errors="replace"))]
    assert not found, found[:10]
    assert "fonts.googleapis" not in (site / "index.html").read_text(encoding="utf-8")


def test_the_config_reference_lists_every_field_with_its_help(site) -> None:
    from trainfit.config import iter_fields

    page = (site / "reference" / "config" / "index.html").read_text(encoding="utf-8")
    missing = [f"{s}.{n}" for s, n, _, _ in iter_fields() if f"<code>{s}.{n}</code>" not in page]
    assert not missing, missing
    assert "Hidden size (d_model)." in page  # model.dim's docstring, as --help prints it


def test_the_generated_parts_are_in_the_pages(site) -> None:
    json_page = (site / "reference" / "json" / "index.html").read_text(encoding="utf-8")
    assert "<code>method_changes</code>" in json_page and "<code>candidates</code>" in json_page
    accuracy = (site / "estimators" / "accuracy" / "index.html").read_text(encoding="utf-8")
    assert "held-out half" in accuracy and "<td>throughput</td>" in accuracy  # the benchmarks' own tables
    assert "<td>analytic</td>" in accuracy and "The whole grid" in accuracy  # the CPU grid's kept run
    estimate = (site / "commands" / "estimate" / "index.html").read_text(encoding="utf-8")
    assert "usage: trainfit estimate" in estimate and "<!--" not in estimate.split("<article")[1]
    from trainfit.models.hf import SUPPORTED_TYPES
    from trainfit.models.presets import PRESETS

    models = (site / "models" / "index.html").read_text(encoding="utf-8")
    assert all(f"<code>{name}</code>" in models for name in (*SUPPORTED_TYPES, *PRESETS))


@pytest.mark.parametrize("args", [
    ("estimate", "--model.preset=llama3-8b", "--hardware.gpu=RTX-4090"),
    ("estimate", "--model.preset=llama3-8b", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=8", "--parallel.pp=2",
     "--training.global_batch_size=64"),
    ("plan", "--model.preset=debug", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=2"),
    ("plan", "--model.preset=debug", "--hardware.gpu=H100-SXM-80GB", "--hardware.num_gpus=2", "--tokens", "1e9"),
])
def test_every_key_of_the_json_answers_is_documented(args) -> None:
    from trainfit.plan.answer_schema import ESTIMATE, MACHINES, PLAN, undocumented

    proc = subprocess.run([sys.executable, "-m", "trainfit", *args, "--json"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    keys = ESTIMATE if args[0] == "estimate" else MACHINES if "--tokens" in args else PLAN
    assert undocumented(json.loads(proc.stdout), keys) == []


def test_readme_is_short_and_its_links_lead_to_pages() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(((?:docs|examples)/[^)#]+)", text)
    assert links and not [link for link in links if not (ROOT / link).exists()]
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert not [link for link in links if link.startswith("docs/") and link.removeprefix("docs/") not in nav]


def runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for match in RUNNABLE.finditer(path.read_text(encoding="utf-8")):
            if match.group(1) not in [script for _, script in blocks]:  # the same example in two places runs once
                blocks.append((str(path.relative_to(ROOT)), match.group(1)))
    return blocks


def test_every_runnable_block_in_readme_and_docs_runs(tmp_path) -> None:
    """Each in a folder of its own beside the repository's examples (what it writes stays there)."""
    blocks = runnable_blocks()
    assert len(blocks) >= 8
    times = []
    for i, (where, script) in enumerate(blocks):
        cwd = tmp_path / str(i)
        cwd.mkdir()
        (cwd / "examples").symlink_to(ROOT / "examples")
        start = time.monotonic()
        proc = subprocess.run(["bash", "-e", "-c", script], cwd=cwd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "COLUMNS": "100"})
        times.append((time.monotonic() - start, where))
        assert proc.returncode == 0, f"{where}:\n{script}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    print(f"{len(blocks)} runnable blocks in {sum(t for t, _ in times):.0f} s; slowest {max(times)}")
