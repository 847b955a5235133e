"""The wheels the GPU suite carries to an offline GPU machine: a closed set, resolved by pip, split
to fit one transfer.

Standard library only (``packaging`` from pip's vendored copy where it is not installed), and
runnable as a file (``python3 titan_upipe/tools/gpu_wheels.py ...``) so that it works before torch and
torchtitan are installed:

    python3 titan_upipe/tools/gpu_wheels.py lock            # where PyPI is reachable: resolve, download, write the lock
    python3 titan_upipe/tools/gpu_wheels.py download .whl   # the lock's wheels, by URL, sha256-checked
    python3 titan_upipe/tools/gpu_wheels.py split .whl      # parts + manifest.json
    python3 titan_upipe/tools/gpu_wheels.py install .whl --target /tmp/site   # reassemble, verify, install
    python3 titan_upipe/tools/gpu_wheels.py pythonpath --target /tmp/site   # PYTHONPATH it needs (.pth entries too)
    python3 titan_upipe/tools/gpu_wheels.py check .whl      # what the suite's --dry-run prints (closure, wheels)
    python3 titan_upipe/tools/gpu_wheels.py list            # name==version of every carried wheel

**The closed set** (``titan_upipe/resources/gpu_wheels.json``, the lock). ``lock`` runs pip's resolver
(``pip install --dry-run --report``) for ``ROOTS`` under ``CONSTRAINTS`` in a scratch Python 3.12
environment whose site-packages holds a stub ``.dist-info`` of every package of the GPU image that
has a recorded version (``titan_upipe/resources/gpu_image_packages.txt``, rewritten by the GPU suite from the
machine's own ``pip list --format=freeze``). Of pip's install list it carries what the image does
not have, minus ``EXCLUDED`` (each with its reason), as far as it is reachable from the roots
through carried packages; the lock keeps each carried wheel's URL, sha256, ``Requires-Dist`` and
whether it holds ``cutlass/cute``. ``closure`` re-checks the lock offline (``make test``): every
requirement of every carried wheel, under its active extras and the GPU machines' markers (CPython
3.12, Linux x86-64), is met by a carried wheel, by the image, or by an exclusion. A package the
image has without a recorded version is accepted by name and listed (the next GPU run's freeze
turns it into a version check).

``.whl/manifest.json`` lists each downloaded wheel with its sha256 and size, and for a wheel larger
than ``PART_BYTES`` the parts it was split into (the wheel itself is then removed, so only parts
travel). ``install`` concatenates the parts, checks the sha256 against the manifest and runs
``pip install --no-index --no-deps --target`` over the reassembled set; the machine's own torch
is never touched.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

try:
    from packaging.markers import Marker
    from packaging.requirements import Requirement
    from packaging.version import Version
except ImportError:  # a bare GPU image: pip's own copy
    from pip._vendor.packaging.markers import Marker  # noqa: F401
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
# Package data (titan_upipe/resources), found from this file: it also runs as a plain script, before
# the package is importable.
RESOURCES = Path(__file__).resolve().parents[1] / "resources"
LOCK = RESOURCES / "gpu_wheels.json"
IMAGE_PACKAGES = RESOURCES / "gpu_image_packages.txt"

PART_BYTES = 60 * 2**20
"""Largest file that travels in one piece (a transfer carries 64 MiB at most)."""

ROOTS = ("torchtitan==0.2.2", "liger-kernel==0.8.5", "flash-attn-4[cu13]==4.0.0b36")
"""What the plugin needs on a GPU machine beyond its image: TorchTitan (the pinned release),
Liger's fused linear+CE and FlashAttention-4 with its CUDA 13 CuTe DSL libraries (the ``cu13``
extra: the machines run torch 2.11+cu130)."""

CONSTRAINTS = {
    "nvidia-cutlass-dsl": ("4.8.1", "the CuTe DSL release FlashAttention-4 4.0.0b36 was compiled with here; "
                                    "4.6.0 and 4.6.1 hang in backward"),
}
"""name -> (version, why): pins the resolver must keep (``-c``)."""

EXCLUDED = {
    "nvidia-cutlass-dsl-libs-cu12": "the CUDA 12 build of the CuTe DSL libraries (92 MB), an unconditional "
                                    "requirement of nvidia-cutlass-dsl; the GPU machines run CUDA 13, and "
                                    "libs-base's loader takes nvidia-cutlass-dsl-libs-cu13 (carried) when it is present",
}
"""name -> why: requirements the closure leaves out on purpose."""

PYTHON = "3.12"
TARGET_MARKERS = {"implementation_name": "cpython", "implementation_version": "3.12.3", "os_name": "posix",
                  "platform_machine": "x86_64", "platform_python_implementation": "CPython",
                  "platform_release": "", "platform_system": "Linux", "platform_version": "",
                  "python_full_version": "3.12.3", "python_version": PYTHON, "sys_platform": "linux"}
"""Environment markers of the GPU machines (CPython 3.12.3, Linux x86-64): the closure is checked
under these whatever the interpreter that checks it."""

CUTE_MODULE = "cutlass/cute/__init__.py"
"""What ``import flash_attn.cute.interface`` needs from the CuTe DSL wheels."""
FA4_MODULE = "flash_attn.cute.interface"


# --- the closed set: the image, the lock, the closure ------------------------------------------


def canonical(name: str) -> str:
    """PEP 503's normalized project name (``Typing_Extensions`` -> ``typing-extensions``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_image(path: Path = IMAGE_PACKAGES) -> dict[str, str | None]:
    """The GPU image's packages: canonical name -> version (None where not recorded)."""
    image = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, _, version = line.partition("==")
        image[canonical(name)] = version.strip() or None
    return image


def write_image(freeze: str, path: Path, source: str) -> dict[str, str | None]:
    """Rewrite the image list from ``pip list --format=freeze`` output (``source``: where and when)."""
    header = ["# The GPU machines' image: its Python packages as `python3 -m pip list --format=freeze` printed",
              f"# them there ({source}), the carried wheels off the path. The wheel closure",
              "# (titan_upipe/resources/gpu_wheels.json, titan_upipe/tools/gpu_wheels.py) is checked against this list; the GPU",
              "# suite rewrites it on every GPU run."]
    body = sorted((line.strip() for line in freeze.splitlines()
                   if "==" in line and not line.startswith("#")), key=str.lower)
    path.write_text("\n".join(header + body) + "\n")
    return read_image(path)


def read_lock(path: Path = LOCK) -> dict:
    return json.loads(path.read_text())


def carried_versions(lock: dict) -> dict[str, str]:
    """Canonical name -> version of every carried wheel."""
    return {canonical(w["name"]): w["version"] for w in lock["wheels"]}


def _contains(specifier, version: str) -> bool:
    return specifier.contains(Version(version), prereleases=True)


class Closure:
    """Requirements followed from ``roots`` through the wheels of ``wheels`` (canonical name ->
    ``{"version", "requires_dist", "requires_python"}``), each met by a wheel, the image or an
    exclusion, under ``TARGET_MARKERS`` and each wheel's active extras."""

    def __init__(self, roots, wheels: dict[str, dict], image: dict[str, str | None],
                 excluded: dict[str, str]) -> None:
        self.extras: dict[str, set[str]] = {}
        """Each reached wheel and the extras asked of it."""
        self.problems: list[str] = []
        self.unverified: dict[str, set[str]] = {}
        """Image packages without a recorded version, and what the wheels ask of them."""
        self.from_image: set[str] = set()
        self.excluded_used: set[str] = set()
        self._wheels, self._image, self._excluded = wheels, image, excluded
        pending = []
        for root in roots:
            pending += self._meet(Requirement(root), "the roots")
        while pending:
            name = pending.pop()
            pending += self._follow(name)

    def _meet(self, req: Requirement, by: str) -> list[str]:
        """Where ``req`` is met; the wheel to follow (again, with new extras), if any."""
        name = canonical(req.name)
        wanted = str(req.specifier) or "any version"
        if name in self._excluded:
            self.excluded_used.add(name)
            return []
        if name in self._wheels:
            version = self._wheels[name]["version"]
            if not _contains(req.specifier, version):
                self.problems.append(f"{by} requires {req.name} {wanted}; the carried wheel is {version}")
            new = set(req.extras) - self.extras.get(name, set())
            if name not in self.extras or new:
                self.extras.setdefault(name, set()).update(req.extras)
                return [name]
            return []
        if name in self._image:
            self.from_image.add(name)
            version = self._image[name]
            if version is None:
                self.unverified.setdefault(name, set()).add(wanted)
            elif not _contains(req.specifier, version):
                self.problems.append(f"{by} requires {req.name} {wanted}; the image has {version}")
            return []
        self.problems.append(f"{by} requires {req.name} {wanted}: neither carried, nor in the image, nor excluded")
        return []

    def _follow(self, name: str) -> list[str]:
        wheel = self._wheels[name]
        label = f"{name} {wheel['version']}"
        requires_python = wheel.get("requires_python")
        if requires_python and not _contains(Requirement(f"python{requires_python}").specifier, TARGET_MARKERS[
                "python_full_version"]):
            self.problems.append(f"{label} requires Python {requires_python}; the GPU machines run {PYTHON}")
        pending = []
        for line in wheel.get("requires_dist") or []:
            req = Requirement(line)
            extras = [""] + sorted(self.extras[name])
            if req.marker is None or any(req.marker.evaluate({**TARGET_MARKERS, "extra": e}) for e in extras):
                pending += self._meet(req, label)
        return pending


def closure(lock: dict, image: dict[str, str | None]) -> Closure:
    """The lock's carried wheels checked against ``image`` (offline): ``Closure.problems`` empty
    means closed; a carried wheel no root reaches is a problem too."""
    wheels = {canonical(w["name"]): w for w in lock["wheels"]}
    result = Closure(lock["roots"], wheels, image, {canonical(n): why for n, why in lock["excluded"].items()})
    shadowing = sorted(n for n in wheels if n in image)
    if shadowing:
        result.problems.append(f"carried wheels the image has too (they would shadow its versions): {shadowing}")
    unreached = sorted(set(wheels) - set(result.extras))
    if unreached:
        result.problems.append(f"carried wheels no root requires: {unreached}")
    return result


def fa4_verdict(lock: dict, result: Closure) -> tuple[bool, str]:
    """Whether the carried set would import ``flash_attn.cute.interface`` on the GPU machines,
    read off the lock: its requirements closed, and some carried wheel holding ``cutlass/cute``."""
    if "flash-attn-4" not in carried_versions(lock):
        return False, f"{FA4_MODULE}: would not import (flash-attn-4 is not carried)"
    if result.problems:
        return False, f"{FA4_MODULE}: would not import (the closure is open: {result.problems[0]})"
    cute = [w["name"] for w in lock["wheels"] if w.get("cute")]
    if not cute:
        return False, f"{FA4_MODULE}: would not import (no carried wheel holds {CUTE_MODULE})"
    return True, f"{FA4_MODULE}: would import (requirements closed; {', '.join(cute)} carries {CUTE_MODULE})"


def _stub_site(site: Path, image: dict[str, str | None]) -> None:
    """A ``.dist-info`` with just a name and version for each image package of known version."""
    for name, version in image.items():
        if version is None:
            continue
        info = site / f"{normalized(name)}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "RECORD").write_text("")


def fits_the_gpu_machines(file: str) -> bool:
    """A wheel file name whose tags install on the GPU machines (CPython 3.12, Linux x86-64)."""
    _, _, rest = file[:-len(".whl")].partition("-")
    *_, python_tag, abi_tag, platform_tag = rest.split("-")
    python_ok = any(t in ("py3", "py312", "cp312") or t == "py2.py3" for t in python_tag.split("."))
    abi_ok = any(t in ("none", "abi3", "cp312") for t in abi_tag.split("."))
    platform_ok = platform_tag == "any" or all(t.endswith("_x86_64") and t.startswith("manylinux")
                                               for t in platform_tag.split("."))
    return python_ok and abi_ok and platform_ok


def resolve(python: str, image: dict[str, str | None]) -> dict:
    """pip's ``--report`` for ``ROOTS`` under ``CONSTRAINTS``, in a scratch environment of ``python``
    (CPython 3.12) that has the image's packages installed as stubs (needs PyPI). The resolver picks
    wheels for the interpreter it runs in, so that must be CPython 3.12 on Linux x86-64."""
    probe = "import platform, sys; print(platform.python_implementation(), sys.version_info[:2] == (3, 12), " \
            "sys.platform, platform.machine())"
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    if found != ["CPython", "True", "linux", "x86_64"]:
        raise SystemExit(f"{python} is {' '.join(found)}: the lock is resolved with CPython 3.12 on Linux x86-64, "
                         "the GPU machines' (pass --python)")
    with tempfile.TemporaryDirectory() as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        site = next(venv.glob("lib/python*/site-packages"))
        _stub_site(site, image)
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("".join(f"{n}=={v}\n" for n, (v, _) in CONSTRAINTS.items()))
        report = Path(tmp) / "report.json"
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--dry-run",
                        "--only-binary=:all:", "--report", str(report), "-c", str(constraints), *ROOTS], check=True)
        out = json.loads(report.read_text())
        out["pip_version"] = out.get("pip_version") or subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "--version"], capture_output=True, text=True).stdout.split()[1]
        out["python_version"] = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                                               capture_output=True, text=True, check=True).stdout.strip()
        return out


def lock_from_report(report: dict, image: dict[str, str | None], date: str) -> dict:
    """The lock: pip's install list minus what the image has and ``EXCLUDED``, as far as the roots
    reach through carried packages; every dropped item with why."""
    candidates, not_carried = {}, {}
    for item in report["install"]:
        meta = item["metadata"]
        name = canonical(meta["name"])
        if name in image:
            not_carried[name] = "in the image" + ("" if image[name] else " (version not recorded)")
            continue
        if name in EXCLUDED:
            not_carried[name] = "excluded: " + EXCLUDED[name]
            continue
        info = item["download_info"]
        url = info["url"]
        candidates[name] = {"name": meta["name"], "version": meta["version"], "file": url.rsplit("/", 1)[-1],
                            "url": url, "sha256": info.get("archive_info", {}).get("hashes", {}).get("sha256"),
                            "requires_python": meta.get("requires_python"),
                            "requires_dist": meta.get("requires_dist", [])}
    reached = Closure(ROOTS, candidates, image, EXCLUDED).extras
    for name in sorted(set(candidates) - set(reached)):
        not_carried[name] = ("pip chose it for a package the image provides; no carried wheel requires it")
    wheels = [candidates[n] for n in sorted(reached)]
    return {"resolved": {"date": date, "python": report.get("python_version"), "pip": report.get("pip_version"),
                         "command": "python3 titan_upipe/tools/gpu_wheels.py lock"},
            "roots": list(ROOTS), "constraints": {n: {"version": v, "why": why} for n, (v, why) in CONSTRAINTS.items()},
            "excluded": dict(EXCLUDED), "wheels": wheels, "not_carried": dict(sorted(not_carried.items()))}


def download(lock: dict, folder: Path) -> list[Path]:
    """Every carried wheel of ``lock`` into ``folder`` from its URL, sha256-checked (needs the index);
    a wheel already there whole (or as the parts of a manifest) is kept."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = {e["file"]: e for e in (_read_manifest(folder) or {}).get("wheels", [])}
    paths = []
    for wheel in lock["wheels"]:
        target = folder / wheel["file"]
        entry = manifest.get(wheel["file"], {})
        split_before = (bool(entry.get("parts")) and entry["sha256"] == wheel["sha256"]
                        and all((folder / part).exists() for part in entry["parts"]))
        if split_before or (target.exists() and _sha256(target) == wheel["sha256"]):
            paths.append(target)
            continue
        with urllib.request.urlopen(wheel["url"]) as response, open(target, "wb") as out:
            out.write(response.read())
        if _sha256(target) != wheel["sha256"]:
            target.unlink()
            raise SystemExit(f"{wheel['file']}: sha256 differs from the lock ({wheel['url']})")
        paths.append(target)
    return paths


def make_lock(python: str, folder: Path, path: Path = LOCK) -> dict:
    """Resolve, download into ``folder`` and write the lock with each wheel's size and whether it
    holds ``cutlass/cute``."""
    image = read_image()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
    lock = lock_from_report(resolve(python, image), image, date)
    for wheel, file in zip(lock["wheels"], download(lock, folder), strict=True):
        whole = file if file.exists() else None
        if whole is None:  # split earlier: reassemble to read it
            whole = next(w for w in reassemble(folder) if w.name == wheel["file"])
        wheel["bytes"] = whole.stat().st_size
        wheel["cute"] = _has_member(whole, CUTE_MODULE)
    path.write_text(json.dumps(lock, indent=1) + "\n")
    return lock


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


def check_closure(lock: dict | None = None, image: dict[str, str | None] | None = None) -> tuple[list[str], list[str]]:
    """(problems, report lines) of the lock's closure over the image (offline), and whether the
    carried set would import FlashAttention-4's interface."""
    lock = read_lock() if lock is None else lock
    image = read_image() if image is None else image
    result = closure(lock, image)
    lines = [f"wheels: {len(lock['wheels'])} carried (titan_upipe/resources/gpu_wheels.json, resolved {lock['resolved']['date']}), "
             f"closure over the image's {len(image)} packages: {'closed' if not result.problems else 'OPEN'}"]
    if result.unverified:
        lines.append("  met by the image by name, its version not recorded yet (the next GPU run's freeze checks): "
                     + ", ".join(f"{n} {'/'.join(sorted(s))}" for n, s in sorted(result.unverified.items())))
    lines += [f"  excluded: {name}: {lock['excluded'][name]}" for name in sorted(result.excluded_used)]
    ok, verdict = fa4_verdict(lock, result)
    lines.append(verdict)
    return result.problems + ([] if ok else [verdict]), lines


def check_manifest(folder: Path, lock: dict | None = None) -> tuple[list[str], list[str]]:
    """(problems, report lines) for the downloaded wheels: present, complete, and exactly the lock's
    (same files, same sha256).

    No manifest is not a problem on a machine that never downloaded the wheels (the report says
    how to get them); a manifest that lacks a locked wheel, or a part, or has another, is."""
    manifest = _read_manifest(folder)
    if manifest is None:
        return [], [f"wheels: no {folder.name}/{MANIFEST} here (run scripts/gpu_wheels.sh where PyPI is reachable "
                    "before carrying the repo to an offline GPU machine)"]
    lock = read_lock() if lock is None else lock
    problems, lines = [], [f"wheels: {len(manifest['wheels'])} in {folder.name}/{MANIFEST}"]
    found = {}
    for entry in manifest["wheels"]:
        found[entry["file"]] = entry
        files = entry["parts"] or [entry["file"]]
        missing = [f for f in files if not (folder / f).exists()]
        if missing:
            problems.append(f"wheel {entry['file']}: missing {', '.join(missing)}")
        too_big = [f for f in files if (folder / f).exists() and (folder / f).stat().st_size > manifest["part_bytes"]]
        if too_big:
            problems.append(f"wheel {entry['file']}: {', '.join(too_big)} larger than one transfer")
        lines.append(f"  {entry['file']} ({entry['bytes'] / 2**20:.1f} MiB" +
                     (f", {len(entry['parts'])} parts)" if entry["parts"] else ")"))
    locked = {w["file"]: w for w in lock["wheels"]}
    for file, wheel in locked.items():
        if file not in found:
            problems.append(f"wheels: {file} of the lock is missing (python3 titan_upipe/tools/gpu_wheels.py download .whl)")
        elif wheel.get("sha256") and found[file]["sha256"] != wheel["sha256"]:
            problems.append(f"wheels: {file} differs from the lock's (sha256)")
    extra = sorted(set(found) - set(locked))
    if extra:
        problems.append(f"wheels: not in the lock (two versions of a package stop the install): {', '.join(extra)}")
    return problems, lines


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
    parser.add_argument("action", choices=["lock", "download", "split", "install", "check", "list", "pythonpath"])
    parser.add_argument("folder", type=Path, nargs="?", default=Path(".whl"))
    parser.add_argument("--target", type=Path, default=Path("/tmp/site"), help="install: where (PYTHONPATH)")
    parser.add_argument("--python", default="python3.12",
                        help="lock: a CPython 3.12 interpreter for the scratch environment (the GPU machines' Python)")
    args = parser.parse_args(argv)
    if args.action == "list":
        print("\n".join(f"{w['name']}=={w['version']}" for w in read_lock()["wheels"]))
    elif args.action == "lock":
        lock = make_lock(args.python, args.folder)
        print(f"{len(lock['wheels'])} wheels locked in {LOCK}, downloaded into {args.folder}")
    elif args.action == "download":
        print(f"{len(download(read_lock(), args.folder))} wheels in {args.folder}")
    elif args.action == "split":
        manifest = split(args.folder)
        print(f"{len(manifest['wheels'])} wheels in {args.folder / MANIFEST}")
    elif args.action == "install":
        install(args.folder, args.target)
        print(f"installed into {args.target}: export PYTHONPATH={':'.join(site_paths(args.target))}:$PYTHONPATH")
    elif args.action == "pythonpath":
        print(":".join(site_paths(args.target)))
    else:
        problems, lines = check_closure()
        manifest_problems, manifest_lines = check_manifest(args.folder)
        problems += manifest_problems
        print("\n".join(lines + manifest_lines + [f"problem: {p}" for p in problems]))
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
