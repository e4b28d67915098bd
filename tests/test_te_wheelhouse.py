"""scripts/te_wheelhouse.py without a registry: pinned files checked by sha256, packed into parts, and
reassembled and unpacked by the vLLM wheelhouse's installer (what the GPU node runs) byte for byte."""
import argparse
import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("te_wheelhouse", ROOT / "scripts" / "te_wheelhouse.py")
te = importlib.util.module_from_spec(spec)
spec.loader.exec_module(te)


@pytest.fixture
def pinned(tmp_path, monkeypatch):
    """Two files of 2.25 and 0.5 MiB (with the tar headers: three parts of 1 MiB), pinned as FILES pins the real ones."""
    files = tmp_path / "files"
    files.mkdir()
    paths, pins = [], {}
    for name, size in (("core-1.0-py3-none-any.whl", 9 << 18), ("ext-1.0.tar.gz", 1 << 19)):
        p = files / name
        p.write_bytes(os.urandom(size))
        pins[name] = ("unused", hashlib.sha256(p.read_bytes()).hexdigest())
        paths.append(p)
    monkeypatch.setattr(te, "FILES", pins)
    return paths


def test_parts_round_trip_through_the_nodes_installer(pinned, tmp_path, capsys):
    lock = te.verified(pinned)
    assert lock == [f"{p.name} --hash=sha256:{te.FILES[p.name][1]}" for p in pinned]
    out = tmp_path / "house"
    out.mkdir()
    manifest = te.pack(pinned, out, 1, "TE test")
    assert [p["name"] for p in manifest["parts"]] == ["part-00", "part-01", "part-02"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    target = tmp_path / "wheels"
    te.wheelhouse.install(argparse.Namespace(parts=str(out), target=str(target)))
    for p in pinned:
        assert (target / p.name).read_bytes() == p.read_bytes()
    assert f"installed TE test into {target}" in capsys.readouterr().out


def test_a_file_that_is_not_the_pinned_one_is_named(pinned):
    pinned[1].write_bytes(b"something else")
    with pytest.raises(SystemExit) as e:
        te.verified(pinned)
    assert str(e.value) == (f"[te-wheelhouse] not the pinned files: ext-1.0.tar.gz: sha256 "
                            f"{hashlib.sha256(b'something else').hexdigest()}, pinned {te.FILES['ext-1.0.tar.gz'][1]}")
