"""Images: built from a directory and pip packages, listed, used by sandboxes; the image CLI."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

from tangram_env.errors import UnknownNameError
from tangram_env.images import ImageError, default_image
from tangram_env.sandbox import SandboxSpec
from tangram_env.server.sandbox import build_image, get_image, list_images, remove_image
from tangram_env.server.sandbox.cli import image_main
from tangram_env.server.sandbox.local import LocalProvider


def make_wheel(folder: Path, name: str = "tinypkg", value: int = 42) -> Path:
    """A real, minimal pure-Python wheel (so installing needs no index and no network)."""
    files = {
        f"{name}/__init__.py": f"VALUE = {value}\n",
        f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
        f"{name}-0.1.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{name}-0.1.dist-info/RECORD,,")
    files[f"{name}-0.1.dist-info/RECORD"] = "\n".join(record) + "\n"
    wheel = folder / f"{name}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "repo"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("def answer():\n    return 41\n")
    (src / "test_mod.py").write_text(
        "from pkg.mod import answer\nassert answer() == 41\nprint('tests pass')\n"
    )
    (src / "run.sh").write_text("#!/bin/sh\necho run\n")
    (src / "run.sh").chmod(0o755)
    (src / "link").symlink_to("pkg/mod.py")
    return src


def test_build_from_dir_and_use(source: Path, image_dir: Path, provider: LocalProvider) -> None:
    image = build_image("repo-image", from_dir=source, env={"PROJECT": "demo"}, root=image_dir)
    assert image.workspace and Path(image.workspace, "pkg", "mod.py").is_file()
    assert "repo-image" in [i.name for i in list_images(image_dir)]
    sb = provider.create(SandboxSpec(image="repo-image"))
    try:
        r = sb.exec("python3 test_mod.py && ./run.sh && readlink link && echo $PROJECT")
        assert r.stdout.split() == ["tests", "pass", "run", "pkg/mod.py", "demo"], r
        sb.exec("echo 'def answer():\n    return 0' > pkg/mod.py; rm run.sh")  # the agent edits the tree
        assert "return 0" in sb.exec("cat pkg/mod.py").stdout
        sb.reset()
        assert sb.exec("python3 test_mod.py").stdout == "tests pass\n"  # back to the image's files
        assert Path(image.workspace, "pkg", "mod.py").read_text().endswith("return 41\n")  # image untouched
    finally:
        sb.close()


def test_build_with_packages(tmp_path: Path, image_dir: Path, provider: LocalProvider) -> None:
    wheel = make_wheel(tmp_path)
    requirements = tmp_path / "requirements.txt"
    requirements.write_text(f"{wheel}\n")
    steps: list[str] = []

    class Recorder:
        def stage(self, description: str, total: int | None) -> None:
            steps.append(description)

        def advance(self, units: int = 1, note: str | None = None) -> None:
            pass

    image = build_image(
        "with-pkg", requirements=requirements, pip_args=["--no-index"], root=image_dir, progress=Recorder()
    )
    assert "tinypkg==0.1" in image.packages and any("installing" in s for s in steps)
    assert image.python and image.python.startswith(str(image_dir))
    sb = provider.create(SandboxSpec(image="with-pkg"))
    try:
        r = sb.exec(["python", "-c", "import sys, tinypkg; print(tinypkg.VALUE, sys.prefix)"])
        assert r.stdout.split() == ["42", image.python], r
        # Only what the image installed: the server's own packages are not in it.
        r = sb.exec(["python", "-c", "import pydantic"])
        assert r.exit_code != 0 and "ModuleNotFoundError" in r.stderr
    finally:
        sb.close()


def test_pip_failure_is_reported_and_leaves_nothing(tmp_path: Path, image_dir: Path) -> None:
    with pytest.raises(ImageError, match="pip install failed"):
        build_image("broken", pip=["surely-not-a-package-xyz"], pip_args=["--no-index"], root=image_dir)
    assert "broken" not in [i.name for i in list_images(image_dir)]
    assert not list(image_dir.glob("broken@*"))


def test_rebuild_replaces_the_old_build(source: Path, image_dir: Path) -> None:
    first = build_image("twice", from_dir=source, root=image_dir)
    (source / "new.txt").write_text("new")
    second = build_image("twice", from_dir=source, root=image_dir)
    assert first.build_dir != second.build_dir and not Path(first.build_dir or "").exists()
    assert Path(second.workspace or "", "new.txt").read_text() == "new"
    remove_image("twice", image_dir)
    assert not Path(second.build_dir or "").exists()


def test_names_and_lookups(image_dir: Path) -> None:
    assert get_image("default", image_dir) == default_image()
    with pytest.raises(UnknownNameError, match="did you mean 'default'"):
        get_image("defualt", image_dir)
    for bad in ("", "../x", "a/b", "x" * 65, "-lead"):
        with pytest.raises(ImageError, match="bad image name"):
            build_image(bad, root=image_dir)
    with pytest.raises(ImageError, match="not a directory"):
        build_image("nodir", from_dir=image_dir / "missing", root=image_dir)
    with pytest.raises(ImageError, match="either"):
        build_image("both", python_env="/usr", pip=["x"], root=image_dir)


def test_host_paths_under_tmp_are_visible_read_only(provider: LocalProvider, tmp_path: Path) -> None:
    # A checkout (or its venv) may live under the host's /tmp: it is bound over the private /tmp.
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("from the host")
    image = build_image("tmp-ro", read_only=[str(shared)], root=provider.image_dir)
    sb = provider.create(SandboxSpec(image=image.name))
    try:
        res = sb.exec(f"cat {shared}/data.txt; touch {shared}/x; echo private > /tmp/mine; cat /tmp/mine")
        assert "from the host" in res.stdout and "private" in res.stdout
        assert not (shared / "x").exists()  # read-only inside
        sb.reset()  # empties the private /tmp, and keeps what is bound over it
        res = sb.exec(f"cat {shared}/data.txt; ls /tmp/mine")
        assert "from the host" in res.stdout and "No such file" in res.stderr, res
    finally:
        sb.close()


def test_paths_each_sandbox_has_its_own_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="has its own /workspace"):
        build_image("in-ws", read_only=["/workspace/x"], root=tmp_path)


def test_image_dir_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_IMAGE_DIR", str(tmp_path / "from-env"))
    build_image("envroot")
    assert (tmp_path / "from-env" / "envroot.json").is_file()


def test_cli_build_list_remove(source: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = str(tmp_path / "cli-images")
    assert image_main(["--root", root, "build", "cli-img", "--from", str(source), "--env", "A=1"]) == 0
    assert "built image" in capsys.readouterr().err
    assert image_main(["--root", root, "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(i["name"], i["env"]) for i in listed] == [("cli-img", {"A": "1"})]
    assert image_main(["--root", root, "list"]) == 0 and "cli-img" in capsys.readouterr().out
    assert image_main(["--root", root, "remove", "cli-img"]) == 0
    assert image_main(["--root", root, "remove", "cli-img"]) == 1
    assert "no sandbox image" in capsys.readouterr().err
    assert image_main(["--root", root, "build", "x", "--env", "novalue"]) == 1
    assert not os.listdir(root) or all(not p.endswith(".json") for p in os.listdir(root))


def test_an_image_whose_environment_is_gone_says_so_before_any_sandbox_starts(tmp_path: Path) -> None:
    from tangram_env.images import Image

    venv = tmp_path / "venv"
    venv.mkdir()
    image = Image(name="gone", python=str(venv))
    assert image.missing_paths() == []
    venv.rmdir()  # removed since the image was built (another checkout's cache, a clean-up)
    assert image.missing_paths() == [str(venv)]
    with pytest.raises(ImageError, match=f"binds {venv}, which no longer exists"):
        image.check_usable()
