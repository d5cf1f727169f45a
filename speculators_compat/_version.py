"""The package version (one place: the package, its report and pyproject.toml agree; tests/test_import.py)."""

__version__ = "0.1.0"
