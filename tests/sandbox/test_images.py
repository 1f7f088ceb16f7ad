"""Sandbox images built for real: mmdebstrap from the host's apt sources, the content-addressed cache, the SIF.

The default image is built once per machine (about two minutes on two cores) and shared through the cache with
test_apptainer_sandbox.py; later runs find it there.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from nemo_gym_prorl.sandbox import images
from nemo_gym_prorl.sandbox.images import ImageError, ImageSpec

REPO = Path(__file__).resolve().parents[2]


def test_apt_sources_come_from_the_host() -> None:
    release = images.host_release()
    listed = subprocess.run(
        ["apt-get", "indextargets", "--format", "$(REPO_URI)"], capture_output=True, text=True, check=True
    ).stdout.split()
    sources = images.apt_sources(release)
    assert sources and all(line.startswith("deb ") and line.split()[1] in listed for line in sources)
    assert any(line.split()[2] == release for line in sources)
    other = images.apt_sources("sid")
    assert all(line.split()[2] == "sid" and line.split()[1] in listed for line in other)


def test_cache_key_follows_the_content() -> None:
    default = images.rootfs_path(ImageSpec())
    assert default == images.rootfs_path(ImageSpec(packages=tuple(reversed(images.DEFAULT_PACKAGES))))
    assert default.parent == images.cache_dir()
    assert default.name.startswith(f"prorl-base-{images.host_release()}-")
    assert images.rootfs_path(ImageSpec(packages=(*images.DEFAULT_PACKAGES, "jq"))) != default
    assert images.rootfs_path(ImageSpec(suite="sid")) != default
    assert images.rootfs_path(ImageSpec(name="other")).name.startswith("other-")


def test_named_images_and_their_keys() -> None:
    assert images.rootfs_path(images.IMAGES["default"]) == images.rootfs_path(ImageSpec())
    scientific = images.IMAGES["scientific"]
    assert set(images.DEFAULT_PACKAGES) < set(scientific.packages)
    assert images.rootfs_path(scientific).name.startswith(f"prorl-scientific-{images.host_release()}-")
    assert images.rootfs_path(scientific.model_copy(update={"path_excludes": ()})) != images.rootfs_path(scientific)


def test_cache_dir_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(images.CACHE_ENV, str(tmp_path))
    assert images.cache_dir() == tmp_path
    assert images.rootfs_path(ImageSpec()).parent == tmp_path


def test_rootfs_is_built_once_then_cached(rootfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = rootfs / images.MANIFEST
    before = manifest.stat()

    def no_rebuild(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached rootfs was built again")

    monkeypatch.setattr(images, "_mmdebstrap", no_rebuild)
    assert images.build_rootfs() == rootfs
    after = manifest.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert not list(rootfs.parent.glob(f".tmp-{rootfs.name}-*"))


def test_rootfs_holds_what_tasks_need_and_runs_under_bwrap(rootfs: Path) -> None:
    for path in ("usr/bin/python3", "usr/bin/git", "usr/bin/setpriv", "usr/bin/prlimit", "workspace", ".prorl"):
        assert (rootfs / path).exists(), path
    assert (rootfs / ".singularity.d/actions/start").stat().st_mode & 0o111
    assert "agent:x:1000:1000" in (rootfs / "etc/passwd").read_text()
    assert not list((rootfs / "var/lib/apt/lists").glob("*_Packages"))
    probe = "import sys, numpy, pytest; print(sys.version_info[0], numpy.__name__, pytest.__name__)"
    bwrap = ["bwrap", "--ro-bind", str(rootfs), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    bwrap += ["--unshare-all", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--"]
    result = subprocess.run([*bwrap, "python3", "-c", probe], check=False, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "3 numpy pytest\n"), result.stderr
    git = subprocess.run([*bwrap, "git", "--version"], check=False, capture_output=True, text=True, timeout=60)
    assert git.returncode == 0 and git.stdout.startswith("git version ")


def test_sif_is_built_and_cached(rootfs: Path, sif: Path) -> None:
    assert sif == images.sif_path(rootfs) and sif.parent == rootfs.parent
    with sif.open("rb") as f:
        assert b"SIF_MAGIC" in f.read(64)
    assert sif.stat().st_size > 10 * 2**20
    before = sif.stat()
    assert images.build_sif(rootfs) == sif
    assert sif.stat().st_mtime_ns == before.st_mtime_ns
    assert not list(sif.parent.glob(f".tmp-{sif.name}-*"))


def test_main_prints_the_cached_paths(rootfs: Path, sif: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert images.main(["--sif"]) == 0
    assert capsys.readouterr().out == f"rootfs: {rootfs}\nsif: {sif}\n"


def test_failed_build_leaves_nothing_and_says_why(tmp_path: Path) -> None:
    spec = ImageSpec(name="broken", suite="no-such-suite-prorl")
    with pytest.raises(ImageError, match="mmdebstrap failed(.|\n)*no-such-suite-prorl"):
        images.build_rootfs(spec, cache=tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [f".{images.rootfs_path(spec, cache=tmp_path).name}.lock"]


def test_sif_of_a_missing_dir_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="not a directory"):
        images.build_sif(tmp_path / "missing")


def test_mmdebstrap_is_required(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ImageError, match="install_apptainer.sh"):
        images.build_rootfs(ImageSpec(name="nothing"), cache=tmp_path)
    assert images.main(["--name", "nothing", "--cache", str(tmp_path)]) == 1
    assert capsys.readouterr().err.startswith("error: mmdebstrap is not installed")


def test_scientific_image_runs_bigcodebench_libraries_without_tex_fonts(scientific_rootfs: Path) -> None:
    """What BigCodeBench's tests import, and wordcloud drawing with the one TeX font kept of its 1.6 GB."""
    probe = ("import pandas, matplotlib.pyplot, sklearn.ensemble, scipy.stats, psutil, seaborn, statsmodels.api\n"
             "from wordcloud import WordCloud\n"
             "print(sorted(WordCloud().generate('alpha beta beta').words_))")  # fmt: skip
    bwrap = ["bwrap", "--ro-bind", str(scientific_rootfs), "/", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    bwrap += ["--unshare-all", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "MPLBACKEND", "Agg"]
    result = subprocess.run([*bwrap, "python3", "-c", probe], check=False, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (0, "['alpha', 'beta']\n"), result.stderr
    fonts = scientific_rootfs / "usr/share/texlive/texmf-dist/fonts"
    assert sorted(p.name for p in fonts.iterdir()) == ["enc", "map", "truetype"]


def test_main_builds_a_named_image(scientific_rootfs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert images.main(["--image", "scientific"]) == 0
    assert capsys.readouterr().out == f"rootfs: {scientific_rootfs}\n"
