"""Where the project's folders are, for tests that read its files (benchmarks/, examples/, src/, docs)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
