"""grpo/trainer/manifest.py: every file under a directory recorded (size, CRC-32), and each way a file can differ
from it named: missing, another size, another content of the same size, an unreadable or missing manifest."""
from __future__ import annotations

import json
import zlib

import pytest

from grpo.trainer import manifest


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"abc" * 1000)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b")
    (tmp_path / "empty").write_bytes(b"")
    manifest.write(tmp_path)
    return tmp_path


def test_every_file_is_recorded_with_its_size_and_crc32(tree):
    files = manifest.read(tree)
    assert sorted(files) == ["a.bin", "empty", "sub/b.txt"]  # the manifest itself apart
    assert files["a.bin"] == {"size": 3000, "crc32": f"{zlib.crc32(b'abc' * 1000):08x}"}
    assert files["empty"] == {"size": 0, "crc32": "00000000"}
    assert manifest.problem(tree) is None and manifest.problem(tree, checksums=False) is None


def test_a_file_read_in_many_blocks_has_the_crc_of_the_whole(tmp_path, monkeypatch):
    monkeypatch.setattr(manifest, "BLOCK", 7)
    (tmp_path / "f").write_bytes(bytes(range(256)) * 3)
    assert manifest.crc32(tmp_path / "f") == f"{zlib.crc32(bytes(range(256)) * 3):08x}"


def test_each_difference_is_named(tree):
    (tree / "sub" / "b.txt").write_text("c")  # same size, other content
    assert manifest.problem(tree) == ("sub/b.txt does not match its checksum (crc32 "
                                      f"{zlib.crc32(b'c'):08x}, the manifest says {zlib.crc32(b'b'):08x})")
    assert manifest.problem(tree, checksums=False) is None  # sizes only: not read
    (tree / "a.bin").write_bytes(b"abc")
    assert manifest.problem(tree) == "a.bin has 3 bytes, the manifest says 3000"
    (tree / "a.bin").unlink()
    assert manifest.problem(tree, checksums=False) == "a.bin is missing"
    (tree / "extra").write_text("a file the manifest does not list is no damage")
    (tree / "a.bin").write_bytes(b"abc" * 1000)
    (tree / "sub" / "b.txt").write_text("b")
    assert manifest.problem(tree) is None


@pytest.mark.parametrize("text,why", [("", "MANIFEST.json is unreadable (0 bytes)"),
                                      ('{"files": {"a": {"size": 1', "MANIFEST.json is unreadable (26 bytes)"),
                                      ('{"files": {"a": {"size": 1}}}\n', "MANIFEST.json is unreadable (30 bytes)"),
                                      ('{"files": [1]}\n', "MANIFEST.json is unreadable (15 bytes)"),
                                      ('[]\n', "MANIFEST.json is unreadable (3 bytes)"),
                                      ('{"files": {}}', "MANIFEST.json is unreadable (13 bytes)")])  # cut: no newline
def test_an_unreadable_manifest_is_named(tree, text, why):
    (tree / manifest.NAME).write_text(text)
    assert manifest.problem(tree) == why
    (tree / manifest.NAME).write_text('{"files": {}}\n')
    assert manifest.problem(tree) is None  # whole: it lists nothing to check


def test_a_missing_manifest_is_named_and_the_command_line_says_it(tree, capsys):
    assert manifest.main([str(tree)]) == 0 and capsys.readouterr().out == f"{tree}: ok\n"
    (tree / manifest.NAME).unlink()
    assert manifest.problem(tree) == "MANIFEST.json is missing"
    assert manifest.main([str(tree)]) == 1 and capsys.readouterr().out == f"{tree}: MANIFEST.json is missing\n"


def test_the_manifest_is_plain_json_with_a_trailing_newline(tree):
    text = (tree / manifest.NAME).read_text()
    assert text.endswith("\n") and json.loads(text)["files"]["sub/b.txt"]["size"] == 1


def test_the_command_line_reads_its_arguments_and_fails_when_any_directory_does(tree, tmp_path, monkeypatch, capsys):
    good = tmp_path / "good"
    good.mkdir()
    manifest.write(good)
    monkeypatch.setattr("sys.argv", ["manifest", str(tree), str(good)])
    (tree / "a.bin").write_bytes(b"")
    assert manifest.main() == 1  # the first bad, the last good: still a failure
    assert capsys.readouterr().out.splitlines() == [f"{tree}: a.bin has 0 bytes, the manifest says 3000", f"{good}: ok"]
