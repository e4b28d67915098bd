"""scripts/vllm_wheelhouse.py without a registry: requirement resolution over synthetic wheels (the
node's packages and the excluded ones left out, extras and markers followed for CPython 3.12 on
Linux x86_64), and the parts' split / verify / reassemble / unpack round trip."""
import hashlib
import importlib.util
import json
import os
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("vllm_wheelhouse", ROOT / "scripts" / "vllm_wheelhouse.py")
wh = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wh)

# name -> Requires-Dist lines of its synthetic wheel
INDEX = {
    "vllm": ["fastapi[standard]<1", "torch==2.11.0", "flashinfer-python==0.6.14", "apache-tvm-ffi==0.1.10",
             "llguidance<2; platform_machine == 'x86_64'", "winonly; sys_platform == 'win32'",
             "oldpy; python_version < '3.10'", "zentorch; extra == 'zen'"],
    "fastapi": ["starlette>=1", "uvicorn; extra == 'standard'", "pydantic>=2"],
    "starlette": ["anyio"], "uvicorn": [], "pydantic": ["pydantic-core==2.50.5"], "pydantic-core": [],
    "llguidance": [], "apache-tvm-ffi": [],
}


def _wheel(dest: Path, name: str) -> Path:
    path = dest / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n%s" % (
        name, "".join(f"Requires-Dist: {r}\n" for r in INDEX[name]))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-1.0.dist-info/METADATA", meta)
    return path


def test_resolve_follows_extras_and_markers_and_leaves_out_the_image_and_excluded(tmp_path, monkeypatch, capsys):
    asked = []

    def fake_download(spec_str, dest, python):
        asked.append(spec_str)
        return _wheel(dest, wh.canonical(spec_str.split("=")[0].split("<")[0].split(">")[0]))

    monkeypatch.setattr(wh, "pip_download", fake_download)
    wheels = wh.resolve("vllm==0.26.0", tmp_path, "3.12", have={"torch", "anyio"})
    assert sorted(wheels) == ["apache-tvm-ffi", "fastapi", "llguidance", "pydantic", "pydantic-core", "starlette",
                              "uvicorn", "vllm"]
    # apache-tvm-ffi's pin is replaced by OVERRIDES (xgrammar needs a newer one than FlashInfer's)
    assert sorted(asked) == sorted(["vllm==0.26.0", "fastapi<1", "llguidance<2", "starlette>=1", "uvicorn",
                                    "pydantic>=2", "pydantic-core==2.50.5", "apache-tvm-ffi>=0.1.11"])
    out = capsys.readouterr().out
    assert "not carried: torch (on the image)" in out
    assert f"not carried: flashinfer-python ({wh.EXCLUDED['flashinfer-python']})" in out


def _manifest(tmp_path: Path, part_mib: int = 1) -> tuple[Path, dict]:
    site = tmp_path / "site" / "vllm"
    site.mkdir(parents=True)
    payload = os.urandom((5 << 20) // 2)      # 2.5 MiB that gzip cannot shrink: 3 parts of 1 MiB
    (site / "_C.abi3.so").write_bytes(payload)
    (site / "__init__.py").write_text("__version__ = '0.26.0'\n")
    archive = tmp_path / "site.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(tmp_path / "site", arcname=".")
    out = tmp_path / "wheelhouse"
    out.mkdir()
    parts = wh.split(archive, out, part_mib)
    manifest = {"vllm": "0.26.0", "compression": "gz", "archive_sha256": wh.sha256(archive), "parts": parts}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out, {"payload": payload, "parts": parts}


def test_parts_round_trip_and_install_is_idempotent(tmp_path, capsys):
    parts_dir, made = _manifest(tmp_path)
    assert [p["bytes"] for p in made["parts"]][:2] == [1 << 20, 1 << 20] and len(made["parts"]) == 3
    assert all(p["sha256"] == hashlib.sha256((parts_dir / p["name"]).read_bytes()).hexdigest() for p in made["parts"])
    target = tmp_path / "target"
    wh.main(["install", "--parts", str(parts_dir), "--target", str(target)])
    assert (target / "vllm" / "_C.abi3.so").read_bytes() == made["payload"]
    assert "installed vLLM 0.26.0" in capsys.readouterr().out
    wh.main(["install", "--parts", str(parts_dir), "--target", str(target)])
    assert "already holds vLLM 0.26.0" in capsys.readouterr().out


def test_install_names_missing_and_corrupt_parts(tmp_path):
    parts_dir, made = _manifest(tmp_path)
    (parts_dir / "part-01").unlink()
    data = bytearray((parts_dir / "part-02").read_bytes())
    data[0] ^= 0xFF
    (parts_dir / "part-02").write_bytes(bytes(data))
    with pytest.raises(SystemExit) as e:
        wh.main(["install", "--parts", str(parts_dir), "--target", str(tmp_path / "t")])
    assert str(e.value) == ("[wheelhouse] cannot install: part-01: missing; "
                            "part-02: size or sha256 differs from manifest.json")
    assert not (tmp_path / "t").exists()


def test_site_python_puts_the_site_first_and_turns_off_the_flashinfer_sampler(tmp_path):
    import subprocess
    import sys

    probe = "import os, sys; print(sys.path[1]); print(os.environ['VLLM_USE_FLASHINFER_SAMPLER'])"
    env = {"PATH": os.environ["PATH"], "VLLM_SITE": str(tmp_path), "VLLM_BASE_PYTHON": sys.executable,
           "PYTHONPATH": "/elsewhere"}
    out = subprocess.run([str(ROOT / "scripts" / "vllm_site_python"), "-c", probe], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(tmp_path), "0"]
    env["VLLM_USE_FLASHINFER_SAMPLER"] = "1"           # the user's choice wins
    out = subprocess.run([str(ROOT / "scripts" / "vllm_site_python"), "-c", probe], env=env,
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(tmp_path), "1"]
