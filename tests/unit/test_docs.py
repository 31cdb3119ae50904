"""The README is a short front door and the topics live in docs/; every repository path they name exists
(a file moved or renamed without its docs fails here)."""
import re
from pathlib import Path

from tests.support.paths import ROOT

PACKAGE = ROOT / "src" / "fivefold"
TOPS = {"src", "tests", "benchmarks", "examples", "docs", "parallel", "model", "plan", "train", "comm", "tools"}


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    assert readme.index("make demo") < readme.index("make test") < 400   # the two commands come first
    for doc in _docs()[1:]:
        assert f"(docs/{doc.name})" in readme, f"docs/{doc.name} is not linked from the README"


def test_every_path_the_docs_name_exists():
    missing = []
    for doc in _docs():
        text = doc.read_text()
        named = re.findall(r"`([\w.-]+(?:/[\w.-]+)+\.(?:py|md|toml|sbatch))`", text)
        named += [link for link in re.findall(r"\]\(([^)#\s]+)\)", text) if "://" not in link]
        for path in named:
            if path.split("/")[0] not in TOPS:
                continue
            if not ((ROOT / path).exists() or (PACKAGE / path).exists() or (doc.parent / path).exists()):
                missing.append(f"{doc.relative_to(ROOT)}: {path}")
    assert not missing, missing
