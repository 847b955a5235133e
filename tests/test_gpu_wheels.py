"""The wheels carried to the offline GPU machines are a closed set: the committed lock
(``titan_upipe/resources/gpu_wheels.json``, pip's resolver's output) checked offline against the committed
image list (``titan_upipe/resources/gpu_image_packages.txt``): every ``Requires-Dist`` of every carried wheel,
under its active extras and the GPU machines' markers, met by a carried wheel, the image or a named
exclusion. The H100 run of 2026-11-23 lost FlashAttention-4 to a hand-written list that omitted
``nvidia-cutlass-dsl-libs-core``: that lock must fail here."""

from __future__ import annotations

import copy

import pytest

from titan_upipe.tools import gpu_wheels


@pytest.fixture(scope="module")
def lock() -> dict:
    return gpu_wheels.read_lock()


@pytest.fixture(scope="module")
def image() -> dict:
    return gpu_wheels.read_image()


def _without(lock: dict, name: str) -> dict:
    broken = copy.deepcopy(lock)
    broken["wheels"] = [w for w in broken["wheels"] if gpu_wheels.canonical(w["name"]) != name]
    return broken


def test_the_committed_lock_is_closed_over_the_image(lock, image):
    problems, lines = gpu_wheels.check_closure(lock, image)
    assert problems == [], problems
    result = gpu_wheels.closure(lock, image)
    carried = gpu_wheels.carried_versions(lock)
    assert {"torchtitan": "0.2.2", "liger-kernel": "0.8.5", "flash-attn-4": "4.0.0b36"}.items() <= carried.items()
    assert carried["nvidia-cutlass-dsl"] == gpu_wheels.CONSTRAINTS["nvidia-cutlass-dsl"][0]
    assert set(result.extras) == set(carried)  # every carried wheel is needed by a root
    # the one exclusion is used, and named with its reason; its 92 MB wheel does not travel
    assert result.excluded_used == {"nvidia-cutlass-dsl-libs-cu12"}
    assert "CUDA 13" in lock["excluded"]["nvidia-cutlass-dsl-libs-cu12"]
    assert "nvidia-cutlass-dsl-libs-cu12" not in carried and "nvidia-cutlass-dsl-libs-cu13" in carried
    # what the image meets by name only is listed, and is exactly the image's unversioned entries used
    assert set(result.unverified) <= {n for n, v in image.items() if v is None}
    # (listed where there are any: the image list of the H200 run, 2026-11-27, records every version)
    assert any("version not recorded" in line for line in lines) == bool(result.unverified)
    assert lines[-1].startswith("flash_attn.cute.interface: would import")


def test_every_locked_wheel_installs_on_the_gpu_machines(lock):
    """CPython 3.12, Linux x86-64: a lock resolved on another machine would carry wheels that do not."""
    assert all(gpu_wheels.fits_the_gpu_machines(w["file"]) for w in lock["wheels"]), [
        w["file"] for w in lock["wheels"] if not gpu_wheels.fits_the_gpu_machines(w["file"])]
    for other in ("numpy-2.0-cp311-cp311-manylinux_2_28_x86_64.whl", "torch-2.11-cp312-cp312-manylinux_2_28_aarch64.whl",
                  "pkg-1.0-cp312-cp312-macosx_11_0_arm64.whl"):
        assert not gpu_wheels.fits_the_gpu_machines(other)


def test_a_lock_without_libs_core_is_open_and_fa4_would_not_import(lock, image):
    """The 2026-11-23 set: no ``nvidia-cutlass-dsl-libs-core`` (which alone holds ``cutlass/cute``)."""
    broken = _without(lock, "nvidia-cutlass-dsl-libs-core")
    problems, lines = gpu_wheels.check_closure(broken, image)
    assert any("nvidia-cutlass-dsl-libs-base 4.8.1 requires nvidia-cutlass-dsl-libs-core ==4.8.1" in p
               for p in problems), problems
    assert lines[-1].startswith("flash_attn.cute.interface: would not import")


def test_a_requirement_the_image_does_not_meet_is_a_problem(lock, image):
    old = dict(image, **{"typing-extensions": "4.0.0"})
    problems, _ = gpu_wheels.check_closure(lock, old)
    assert any("requires typing-extensions >=4.10.0; the image has 4.0.0" in p for p in problems), problems


def test_an_exclusion_must_be_named(lock, image):
    broken = copy.deepcopy(lock)
    broken["excluded"] = {}
    problems, _ = gpu_wheels.check_closure(broken, image)
    assert any("nvidia-cutlass-dsl-libs-cu12 ==4.8.1: neither carried, nor in the image, nor excluded" in p
               for p in problems), problems


def test_a_carried_wheel_the_image_has_would_shadow_it(lock, image):
    problems, _ = gpu_wheels.check_closure(lock, dict(image, tyro="0.9.0"))
    assert any("would shadow" in p and "tyro" in p for p in problems), problems


def test_extras_and_markers_are_the_gpu_machines():
    """``extra == "cu13"`` requirements count only where the extra is asked for; markers evaluate
    for CPython 3.12 on Linux x86-64 whatever interpreter checks them."""
    wheels = {
        "app": {"version": "1.0", "requires_dist": ["dsl[cu13]>=1", "old-only; python_version < '3.12'",
                                                     "new-only; python_version >= '3.12' and sys_platform == 'linux'"]},
        "dsl": {"version": "1.0", "requires_dist": ["libs-cu13; extra == 'cu13'", "libs-qnx; extra == 'qnx'"]},
        "libs-cu13": {"version": "1.0"},
    }
    result = gpu_wheels.Closure(["app==1.0"], wheels, {}, {})
    assert result.extras == {"app": set(), "dsl": {"cu13"}, "libs-cu13": set()}
    assert result.problems == ["app 1.0 requires new-only any version: neither carried, nor in the image, nor excluded"]
    without_extra = gpu_wheels.Closure(["app==1.0"], dict(wheels, app={"version": "1.0", "requires_dist": ["dsl>=1"]}),
                                       {}, {})
    assert "libs-cu13" not in without_extra.extras


def test_the_lock_is_pips_install_list_minus_the_image_exclusions_and_the_unreached():
    report = {"install": [
        {"metadata": {"name": name, "version": "1.0", "requires_dist": deps},
         "download_info": {"url": f"https://host/{name}-1.0-py3-none-any.whl",
                           "archive_info": {"hashes": {"sha256": name * 2}}}}
        for name, deps in (("torchtitan", ["tyro", "pandas"]), ("liger_kernel", []), ("tyro", []),
                           ("flash-attn-4", ["nvidia-cutlass-dsl"]), ("nvidia-cutlass-dsl", ["nvidia-cutlass-dsl-libs-cu12"]),
                           ("nvidia-cutlass-dsl-libs-cu12", []), ("pandas", ["tzdata"]), ("tzdata", []))]}
    lock = gpu_wheels.lock_from_report(report, {"pandas": None}, "2026-11-25")
    assert [w["name"] for w in lock["wheels"]] == ["flash-attn-4", "liger_kernel", "nvidia-cutlass-dsl", "torchtitan",
                                                    "tyro"]
    assert lock["not_carried"] == {
        "nvidia-cutlass-dsl-libs-cu12": "excluded: " + gpu_wheels.EXCLUDED["nvidia-cutlass-dsl-libs-cu12"],
        "pandas": "in the image (version not recorded)",
        "tzdata": "pip chose it for a package the image provides; no carried wheel requires it"}
    assert lock["wheels"][0]["sha256"] == "flash-attn-4" * 2 and lock["roots"] == list(gpu_wheels.ROOTS)


def test_the_image_list_round_trips_a_pip_freeze(tmp_path):
    path = tmp_path / "image.txt"
    image = gpu_wheels.write_image("torch==2.11.0+cu130\nTyping_Extensions==4.15.0\n# comment\n-e git+x#egg=y\n",
                                   path, "NVIDIA H100 80GB HBM3, 2026-11-25")
    assert image == {"torch": "2.11.0+cu130", "typing-extensions": "4.15.0"}
    assert "NVIDIA H100 80GB HBM3, 2026-11-25" in path.read_text()


def test_the_manifest_must_hold_exactly_the_lock(tmp_path, lock):
    small = dict(lock, wheels=[w for w in lock["wheels"] if w["name"] in ("tyro", "dill")])
    for wheel in small["wheels"]:
        (tmp_path / wheel["file"]).write_bytes(b"not the real wheel")
    (tmp_path / "stray-1.0-py3-none-any.whl").write_bytes(b"x")
    gpu_wheels.split(tmp_path)
    problems, _ = gpu_wheels.check_manifest(tmp_path, small)
    assert sum("differs from the lock's (sha256)" in p for p in problems) == 2
    assert any("not in the lock" in p and "stray-1.0" in p for p in problems)
    problems, _ = gpu_wheels.check_manifest(tmp_path, lock)
    assert any("of the lock is missing" in p and "torchtitan" in p for p in problems)
