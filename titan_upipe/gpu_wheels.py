"""The wheels the GPU suite carries to an offline GPU machine, split to fit one transfer.

Standard library only, and runnable as a file (``python3 titan_upipe/gpu_wheels.py ...``) so that
it works before torch and torchtitan are installed:

    python3 titan_upipe/gpu_wheels.py split .whl      # after pip download: parts + manifest.json
    python3 titan_upipe/gpu_wheels.py install .whl --target /tmp/site   # reassemble, verify, install
    python3 titan_upipe/gpu_wheels.py pythonpath --target /tmp/site   # PYTHONPATH it needs (.pth entries too)
    python3 titan_upipe/gpu_wheels.py check .whl      # what the suite's --dry-run prints
    python3 titan_upipe/gpu_wheels.py list            # name==version of every wheel to download

``.whl/manifest.json`` lists each wheel with its sha256 and size, and for a wheel larger than
``PART_BYTES`` the parts it was split into (the wheel itself is then removed, so only parts
travel). ``install`` concatenates the parts, checks the sha256 against the manifest and runs
``pip install --no-index --no-deps --target`` over the reassembled set; the machine's own torch
is never touched.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

PART_BYTES = 60 * 2**20
"""Largest file that travels in one piece (a transfer carries 64 MiB at most)."""

REQUIRED = {
    # the plugin's own needs beyond torch
    "torchtitan": "0.2.2",
    "liger-kernel": "0.8.5",
    "flash-attn-4": "4.0.0b36",
    "tomli": "2.5.0",
    # FlashAttention-4's CuTe DSL stack (the cu13 libs match the machines' CUDA 13)
    "nvidia-cutlass-dsl": "4.8.1",
    "nvidia-cutlass-dsl-libs-base": "4.8.1",
    "nvidia-cutlass-dsl-libs-cu13": "4.8.1",
    "quack-kernels": "0.6.5",
    "apache-tvm-ffi": "0.1.15.post2",
    "torch-c-dlpack-ext": "0.1.5",
    # what `import torchtitan` pulls in that the GPU image lacks (its pandas, pyarrow, xxhash,
    # fsspec, huggingface-hub, requests, pyyaml and tqdm are used as they are)
    "datasets": "5.2.0",
    "dill": "0.4.1",
    "multiprocess": "0.70.19",
    "torchdata": "0.11.0",
    "tyro": "1.0.17",
    "docstring-parser": "0.18.0",
    "typeguard": "4.6.0",
}
"""pip name -> version: every wheel the suite carries (``scripts/gpu_wheels.sh`` downloads exactly
these, ``--no-deps``). What the GPU machines lack beyond their torch 2.11, triton, tensorboard and
the image's other packages (``../shared/notes/gpu.md``, the device tool's package list); versions
are the ones this project's CI environment resolves for torchtitan 0.2.2."""


def normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def wheel_name(file_name: str) -> tuple[str, str]:
    """``flash_attn_4-4.0.0b36-py3-none-any.whl`` -> ("flash_attn_4", "4.0.0b36")."""
    name, version = file_name.split("-")[:2]
    return normalized(name), version


def split(folder: Path, part_bytes: int = PART_BYTES) -> dict:
    """Write ``manifest.json`` for the wheels in ``folder``, splitting those over ``part_bytes``."""
    entries = []
    for wheel in sorted(folder.glob("*.whl")):
        entry = {"file": wheel.name, "sha256": _sha256(wheel), "bytes": wheel.stat().st_size, "parts": []}
        if entry["bytes"] > part_bytes:
            with open(wheel, "rb") as f:
                for index, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
                    part = folder / f"{wheel.name}.part-{index:02d}"
                    part.write_bytes(block)
                    entry["parts"].append(part.name)
            wheel.unlink()
        entries.append(entry)
    old = _read_manifest(folder)
    kept = [e for e in (old or {}).get("wheels", []) if e["parts"] and e["file"] not in {n["file"] for n in entries}]
    manifest = {"part_bytes": part_bytes, "wheels": kept + entries}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _read_manifest(folder: Path) -> dict | None:
    path = folder / MANIFEST
    return json.loads(path.read_text()) if path.exists() else None


def reassemble(folder: Path) -> list[Path]:
    """Every wheel of the manifest whole in ``folder`` (parts concatenated), sha256-checked."""
    manifest = _read_manifest(folder)
    if manifest is None:
        raise SystemExit(f"no {folder / MANIFEST}: run scripts/gpu_wheels.sh where PyPI is reachable")
    wheels = []
    for entry in manifest["wheels"]:
        target = folder / entry["file"]
        if entry["parts"]:  # always from the parts: a wheel left from an interrupted run may be partial
            with open(target, "wb") as out:
                for part in entry["parts"]:
                    out.write((folder / part).read_bytes())
        if _sha256(target) != entry["sha256"]:
            raise SystemExit(f"{target}: sha256 differs from the manifest (a part is missing or damaged)")
        wheels.append(target)
    return wheels


def check_manifest(folder: Path) -> tuple[list[str], list[str]]:
    """(problems, report lines) for the carried wheels: present, complete, the required set.

    No manifest is not a problem on a machine that never downloaded the wheels (the report says
    how to get them); a manifest that lacks a required wheel, or a part, is."""
    manifest = _read_manifest(folder)
    if manifest is None:
        return [], [f"wheels: no {folder.name}/{MANIFEST} here (run scripts/gpu_wheels.sh where PyPI is reachable "
                    "before carrying the repo to an offline GPU machine)"]
    problems, lines = [], [f"wheels: {len(manifest['wheels'])} in {folder.name}/{MANIFEST}"]
    found = {}
    for entry in manifest["wheels"]:
        name, version = wheel_name(entry["file"])
        found[name] = version
        files = entry["parts"] or [entry["file"]]
        missing = [f for f in files if not (folder / f).exists()]
        if missing:
            problems.append(f"wheel {entry['file']}: missing {', '.join(missing)}")
        too_big = [f for f in files if (folder / f).exists() and (folder / f).stat().st_size > manifest["part_bytes"]]
        if too_big:
            problems.append(f"wheel {entry['file']}: {', '.join(too_big)} larger than one transfer")
        lines.append(f"  {entry['file']} ({entry['bytes'] / 2**20:.1f} MiB" +
                     (f", {len(entry['parts'])} parts)" if entry["parts"] else ")"))
    for name, version in REQUIRED.items():
        key = normalized(name)
        if key not in found:
            problems.append(f"wheels: {key} is missing (scripts/gpu_wheels.sh downloads it)")
        elif found[key] != version:
            problems.append(f"wheels: {key} {found[key]}, the suite is validated with {version}")
    whole = [folder / e["file"] for e in manifest["wheels"] if not e["parts"] and (folder / e["file"]).exists()]
    if "flash_attn_4" in found and whole and not any(_has_member(w, CUTE_MODULE) for w in whole):
        lines.append(f"warning: flash-attn-4 imports cutlass.cute, and no carried wheel has {CUTE_MODULE}: FlashAttention-4 "
                     "will not import on the GPU machine (its contract and varlen checks report it skipped; "
                     "the CuTe DSL wheels 4.4-4.8 from this index ship only cutlass/_mlir, seen 2026-11-23)")
    return problems, lines


CUTE_MODULE = "cutlass/cute/__init__.py"
"""What ``import flash_attn.cute.interface`` needs from the CuTe DSL wheels."""


def _has_member(wheel: Path, suffix: str) -> bool:
    with zipfile.ZipFile(wheel) as archive:
        return any(name.endswith(suffix) for name in archive.namelist())


def install(folder: Path, target: Path) -> None:
    wheels = reassemble(folder)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--upgrade", "--target", str(target), *map(str, wheels)], check=True)


def site_paths(target: Path) -> list[str]:
    """The ``sys.path`` entries ``target`` needs: itself and what its ``.pth`` files add.

    Python runs ``.pth`` files only in site directories, never in a ``PYTHONPATH`` entry, and
    the CuTe DSL meta package puts its ``cutlass`` modules on the path with one
    (``nvidia_cutlass_dsl_packages.pth``): without its entry FlashAttention-4 fails to import.
    Read off in a child interpreter that makes ``target`` a site directory."""
    probe = ("import site, sys; before = list(sys.path); site.addsitedir(sys.argv[1]); "
             "print('\\n'.join(p for p in sys.path if p not in before))")
    out = subprocess.run([sys.executable, "-c", probe, str(target)], check=True, capture_output=True, text=True)
    paths = [line for line in out.stdout.splitlines() if line]
    return [str(target)] + [p for p in paths if p != str(target)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["split", "install", "check", "list", "pythonpath"])
    parser.add_argument("folder", type=Path, nargs="?", default=Path(".whl"))
    parser.add_argument("--target", type=Path, default=Path("/tmp/site"), help="install: where (PYTHONPATH)")
    args = parser.parse_args(argv)
    if args.action == "list":
        print("\n".join(f"{name}=={version}" for name, version in REQUIRED.items()))
    elif args.action == "split":
        manifest = split(args.folder)
        print(f"{len(manifest['wheels'])} wheels in {args.folder / MANIFEST}")
    elif args.action == "install":
        install(args.folder, args.target)
        print(f"installed into {args.target}: export PYTHONPATH={':'.join(site_paths(args.target))}:$PYTHONPATH")
    elif args.action == "pythonpath":
        print(":".join(site_paths(args.target)))
    else:
        problems, lines = check_manifest(args.folder)
        print("\n".join(lines + [f"problem: {p}" for p in problems]))
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
