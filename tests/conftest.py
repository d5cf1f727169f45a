import os

# Keep engines small and offline on a 2-core, 24 GiB machine.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


import subprocess  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def small_disk(tmp_path):
    """``make(size)``: a folder on a tmpfs of that size ("1m", "4m"): a disk that fills up for real.
    Skips where this machine cannot mount one (it needs root)."""
    mounted = []

    def make(size: str):
        d = tmp_path / f"disk-{len(mounted)}"
        d.mkdir()
        p = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True, text=True
        )
        if p.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {p.stderr.strip()}")
        mounted.append(d)
        return d

    yield make
    for d in mounted:
        subprocess.run(["umount", "-l", str(d)], check=False)
