"""The foundation's tooling: upstream cache, patch series apply/export round trip, upstream checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "ci"))

import check_upstream  # noqa: E402
import lint  # noqa: E402
import patches  # noqa: E402
import summarize  # noqa: E402
import upstream  # noqa: E402

IDENT = {"GIT_AUTHOR_NAME": "Test Author", "GIT_AUTHOR_EMAIL": "author@example.invalid",
         "GIT_AUTHOR_DATE": "2026-11-01T12:00:00Z"}


@pytest.fixture(scope="module")
def pinned_tree() -> Path:
    return upstream.fetch()


def append(path: str, text: str) -> Callable[[Path], int]:
    """An edit for commit_change: append ``text`` to ``path`` in the tree."""
    return lambda t: (t / path).write_text((t / path).read_text() + text)


HEADER = "# PR test: the test patches\n"


def new_series(tmp_path: Path, name: str = "series", text: str = HEADER) -> Path:
    """A patch folder whose ``series`` holds only PR headers (``text``): where ``export`` puts new patches."""
    d = tmp_path / name
    d.mkdir()
    (d / "series").write_text(text)
    return d


def commit_change(tree: Path, message: str, edit) -> None:
    edit(tree)
    patches.git(tree, "add", "-A")
    patches.git(tree, "commit", "-q", "-m", message, env=IDENT)


def test_cached_tree_is_the_pinned_tree(pinned_tree: Path) -> None:
    pin = upstream.TREES[upstream.PIN]
    assert upstream.tarball_path().exists() and pin.role == "pin" and upstream.PIN in upstream.CHECKED
    # the reference tree is the pinned tree: its enum ends at Q2_0 = 42
    text = (pinned_tree / "ggml/include/ggml.h").read_text()
    assert "GGML_TYPE_Q2_0    = 42" in text
    sdist = upstream.cache_root() / "downloads" / pin.sdist.filename
    assert not sdist.exists() or upstream.sha256_file(sdist) == pin.sdist.sha256
    # every file of the tree is in the tarball: its git tree hash is the recorded one (the sdist has no git metadata)
    repo = upstream.cache_root() / "upstream" / f"identity-{os.getpid()}"
    try:
        upstream.extract_tree(upstream.PIN, repo)
        assert upstream._git(repo, "rev-parse", f"{upstream.commit_all(repo, 'check')}^{{tree}}") == pin.tree_hash
    finally:
        shutil.rmtree(repo, ignore_errors=True)


def test_a_tree_of_other_files_is_refused(tmp_path: Path, pinned_tree: Path) -> None:
    """A checkout offered as the pin must be the pin's files (the recorded tree hash), whatever its commit."""
    other = tmp_path / "other"
    upstream.extract_tree(upstream.PIN, other)
    append("README.md", "one more line\n")(other)
    upstream.commit_all(other, "not the pin")
    with pytest.raises(upstream.UpstreamError, match="is not b11549's recorded"):
        upstream.from_checkout(upstream.TREES[upstream.PIN], other)
    with pytest.raises(upstream.UpstreamError, match="unknown upstream tree 'b1'"):
        upstream.fetch("b1")


def test_second_fetch_downloads_nothing(monkeypatch, pinned_tree: Path) -> None:
    def no_network(*a, **k):
        raise AssertionError("fetch tried to download although the cache is complete")
    monkeypatch.setattr(upstream, "download_sdist", no_network)
    monkeypatch.setattr(upstream, "resolve_git", no_network)
    assert upstream.fetch() == pinned_tree


@pytest.mark.parametrize("route", ["index", "pip"])
def test_sdist_with_wrong_checksum_is_refused(monkeypatch, tmp_path: Path, route: str) -> None:
    """Whichever way the bytes arrive (the index's JSON API, or pip when that fails), tampered bytes are refused
    and nothing is left under the final name. No network: both routes are replaced by fakes."""
    monkeypatch.setenv("S3D8_CACHE", str(tmp_path))
    (tmp_path / "downloads").mkdir()
    sdist = upstream.TREES[upstream.PIN].sdist
    bogus = tmp_path / "downloads" / sdist.filename
    bogus.write_bytes(b"not the sdist")

    def fake_index(sd, dest: Path) -> Path:
        if route == "pip":
            raise urllib.error.URLError("no JSON API here")
        (dest / sd.filename).write_bytes(b"tampered")
        return dest / sd.filename

    def fake_pip(cmd, **kw):  # pip "downloads" bogus bytes too
        assert route == "pip", "pip was asked although the index answered"
        dest = Path(cmd[cmd.index("-d") + 1])
        (dest / sdist.filename).write_bytes(b"tampered")
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(upstream, "_download_from_index", fake_index)
    monkeypatch.setattr(upstream, "_run", fake_pip)
    with pytest.raises(upstream.UpstreamError, match="sha256"):
        upstream.download_sdist(sdist)
    assert bogus.read_bytes() == b"not the sdist"  # the cached file was not replaced by the tampered one


def test_empty_series_round_trips(tmp_path: Path, pinned_tree: Path) -> None:
    empty = tmp_path / "series"
    empty.mkdir()
    tree = patches.apply(tmp_path / "tree", empty)
    assert patches.git(tree, "rev-list", "--count", f"{patches.BASE_TAG}..HEAD").stdout.strip() == "0"
    assert patches.export(tree, empty) == []
    patches.check(empty)


def declare_type(header: Path, declaration: str) -> None:
    """Add ``declaration`` (``GGML_TYPE_X = 96``) to ggml.h's type enum, before GGML_TYPE_COUNT (then 97)."""
    header.write_text(header.read_text().replace("GGML_TYPE_COUNT   = 43,", f"{declaration},\n        GGML_TYPE_COUNT   = 97,"))


def test_series_round_trips_byte_identically(tmp_path: Path, pinned_tree: Path) -> None:
    series = new_series(tmp_path)
    tree = patches.apply(tmp_path / "tree", series)

    def edit_header(t: Path) -> None:
        declare_type(t / "ggml/include/ggml.h", "GGML_TYPE_XTEST  = 96")

    def add_files(t: Path) -> None:
        (t / "docs/s3d8-test.md").write_text("new file\nwith two lines\n")
        (t / "crlf.txt").write_bytes(b"windows\r\nline endings\r\n")

    commit_change(tree, "ggml : add a test type\n\nBody explaining why.", edit_header)
    commit_change(tree, "docs : new files", add_files)
    exported = patches.export(tree, series)
    assert [patches.name(p, series) for p in exported] == ["test/01-ggml-add-test-type.patch",
                                                          "test/02-docs-new-files.patch"]
    assert (series / "series").read_text() == HEADER + "test/01-ggml-add-test-type.patch\ntest/02-docs-new-files.patch\n"
    first = exported[0].read_text()
    assert first.startswith("From 0000000000000000000000000000000000000000 ")  # no commit hashes
    assert "Body explaining why." in first
    before = {p.name: p.read_bytes() for p in exported}
    patches.check(series)  # apply → export in a temp dir reproduces the bytes
    # and a second export from a fresh apply is byte-identical too
    tree2 = patches.apply(tmp_path / "tree2", series)
    again = new_series(tmp_path, "again")
    patches.export(tree2, again)
    assert {p.name: p.read_bytes() for p in patches.series(again)} == before
    assert (tree2 / "crlf.txt").read_bytes() == b"windows\r\nline endings\r\n"
    assert check_upstream.series_type_ids(series) == {"GGML_TYPE_XTEST": 96}


def test_patch_that_no_longer_applies_fails_clearly(tmp_path: Path, pinned_tree: Path) -> None:
    series = new_series(tmp_path)
    tree = patches.apply(tmp_path / "tree", series)
    commit_change(tree, "ggml : touch the header",
                  lambda t: (t / "ggml/include/ggml.h").write_text((t / "ggml/include/ggml.h").read_text() + "// x\n"))
    [p] = patches.export(tree, series)
    p.write_text(p.read_text().replace(" #ifdef  __cplusplus\n", " #ifdef  __cplusplus_changed_upstream\n"))
    with pytest.raises(patches.PatchError, match=r"patch test/01-ggml-touch-header.patch does not apply cleanly") as e:
        patches.apply(tmp_path / "tree3", series)
    assert "ggml/include/ggml.h" in str(e.value)
    # `git am -3` leaves the session open so that the conflict can be resolved in place, and says how
    assert "git am --continue" in str(e.value) and "ci/patches.py export" in str(e.value)
    assert (tmp_path / "tree3" / ".git" / "rebase-apply").is_dir()


def test_conflict_is_resolved_in_place_and_am_continue_applies_the_rest(tmp_path: Path, pinned_tree: Path) -> None:
    """Three patches, the middle one no longer applies: apply stops at it (naming it), the first is committed, the
    tree is left in `git am`'s state; resolving it and `git am --continue` applies the
    third too, and export then writes the resolved series."""
    series = new_series(tmp_path)
    tree = patches.apply(tmp_path / "tree", series)

    commit_change(tree, "docs : first", append("README.md", "\nfirst\n"))
    commit_change(tree, "ggml : second", append("ggml/include/ggml.h", "// second\n"))
    commit_change(tree, "docs : third", append("README.md", "third\n"))
    first, second, third = patches.export(tree, series)
    # upstream "moved" the header's last line: the second patch's context no longer matches
    second.write_text(second.read_text().replace(" #endif\n+// second", " #endif // moved\n+// second"))
    stuck = tmp_path / "stuck"
    with pytest.raises(patches.PatchError, match=r"patch test/02-ggml-second.patch does not apply cleanly") as e:
        patches.apply(stuck, series)
    assert "git am --continue" in str(e.value)
    assert (stuck / ".git" / "rebase-apply").is_dir()
    log = patches.git(stuck, "log", "--format=%s", f"{patches.BASE_TAG}..HEAD").stdout.split("\n")
    assert log[0] == "docs : first"
    # resolve: take the patch's intent by hand, then continue
    h = stuck / "ggml/include/ggml.h"
    h.write_text(h.read_text() + "// second\n")
    patches.git(stuck, "add", "ggml/include/ggml.h")
    patches.git(stuck, "am", "--continue", env=IDENT)
    subjects = patches.git(stuck, "log", "--reverse", "--format=%s", f"{patches.BASE_TAG}..HEAD").stdout.split()
    assert " ".join(subjects) == "docs : first ggml : second docs : third"
    assert (stuck / "README.md").read_text().endswith("\nfirst\nthird\n")


def test_a_new_patch_joins_the_pr_before_it(tmp_path: Path, pinned_tree: Path) -> None:
    """export keeps series' preamble, PR headers and their comment lines; a patch inserted after a PR's last patch
    joins that PR (numbered after it), a patch whose line is moved under another header moves to that PR, and the
    other files keep their names and bytes."""
    text = "# the series\n\n# PR one: the first PR\n# what it does\n\n# PR two: the second PR\n"
    series = new_series(tmp_path, text=text)
    tree = patches.apply(tmp_path / "tree", series)
    commit_change(tree, "docs : first", append("README.md", "\nfirst\n"))
    commit_change(tree, "docs : last", append("README.md", "last\n"))
    # new patches at the start join the first PR
    patches.export(tree, series)
    assert (series / "series").read_text() == ("# the series\n\n# PR one: the first PR\n# what it does\n"
                                               "one/01-docs-first.patch\none/02-docs-last.patch\n\n"
                                               "# PR two: the second PR\n")
    # move the last patch to PR two by its line, as a maintainer would, and export again: it is renamed
    (series / "series").write_text((series / "series").read_text().replace("one/02-docs-last.patch\n", "")
                                   + "one/02-docs-last.patch\n")
    before = {patches.name(p, series): p.read_bytes() for p in patches.export(tree, series)}
    assert list(before) == ["one/01-docs-first.patch", "two/01-docs-last.patch"]
    assert not (series / "one" / "02-docs-last.patch").exists()
    # insert a commit between the two (rebase onto a new middle commit): it joins PR one
    patches.git(tree, "checkout", "-q", "-b", "mid", "HEAD~1")
    commit_change(tree, "ggml : middle", append("ggml/include/ggml.h", "// middle\n"))
    patches.git(tree, "cherry-pick", "main", env=IDENT)
    after = {patches.name(p, series): p.read_bytes() for p in patches.export(tree, series)}
    assert (series / "series").read_text() == ("# the series\n\n# PR one: the first PR\n# what it does\n"
                                               "one/01-docs-first.patch\none/02-ggml-middle.patch\n\n"
                                               "# PR two: the second PR\ntwo/01-docs-last.patch\n")
    assert set(after) - set(before) == {"one/02-ggml-middle.patch"}
    assert all(after[name] == data for name, data in before.items())
    assert [(g.name, g.title, [patches.name(f, series) for f in files]) for g, files in patches.groups(series)] == [
        ("one", "the first PR", ["one/01-docs-first.patch", "one/02-ggml-middle.patch"]),
        ("two", "the second PR", ["two/01-docs-last.patch"])]
    patches.check(series)  # the round trip keeps the headers byte for byte


def test_export_refuses_prs_out_of_order_and_a_series_without_prs(tmp_path: Path, pinned_tree: Path) -> None:
    series = new_series(tmp_path, text="# PR one: first\n\n# PR two: second\n")
    tree = patches.apply(tmp_path / "tree", series)
    commit_change(tree, "docs : first", append("README.md", "\nfirst\n"))
    commit_change(tree, "docs : second", lambda t: (t / "NOTE.md").write_text("note\n"))
    patches.export(tree, series)
    text = (series / "series").read_text()
    (series / "series").write_text(text.replace("one/02-docs-second.patch\n", "") + "one/02-docs-second.patch\n")
    patches.export(tree, series)  # now one/01-docs-first.patch, two/01-docs-second.patch
    # the commits swapped: PR two's patch would come before PR one's
    patches.git(tree, "rebase", "-q", "--onto", patches.BASE_TAG, "HEAD~1", env=IDENT)
    commit_change(tree, "docs : first", append("README.md", "\nfirst\n"))
    with pytest.raises(patches.PatchError, match=r"patch 'docs : first' of PR one comes after a patch of PR two"):
        patches.export(tree, series)
    assert [patches.name(p, series) for p in patches.series(series)] == ["one/01-docs-first.patch",
                                                                          "two/01-docs-second.patch"]  # untouched
    with pytest.raises(patches.PatchError, match=r"no `# PR <name>: <title>` header"):
        patches.export(tree, tmp_path / "bare")


def test_series_file_and_folder_must_agree(tmp_path: Path) -> None:
    d = tmp_path / "series"
    (d / "x").mkdir(parents=True)
    (d / "x" / "01-a.patch").write_text("x")
    with pytest.raises(patches.PatchError, match="no series file"):
        patches.series(d)
    (d / "series").write_text("# PR x: the x PR\nx/01-a.patch\nx/02-b.patch\n")
    with pytest.raises(patches.PatchError, match="listed but missing: x/02-b.patch"):
        patches.series(d)
    (d / "series").write_text("# PR x: the x PR\n")
    with pytest.raises(patches.PatchError, match="not listed: x/01-a.patch"):
        patches.series(d)
    (d / "series").write_text("# comment\n\n# PR x: the x PR\n# about x\nx/01-a.patch\n")
    assert patches.series(d) == [d / "x" / "01-a.patch"]
    layout = patches.read_layout(d)
    assert layout.preamble == ["# comment", ""] and layout.groups[0].text == ["# PR x: the x PR", "# about x"]
    assert layout.render() == (d / "series").read_text()
    # a patch outside any PR, a malformed or repeated header, a comment between a PR's patches: refused, with the line
    for text, error in (("x/01-a.patch\n# PR x: the x PR\n", r"series:1: x/01-a.patch belongs to no PR"),
                        ("# PR X: upper case\nx/01-a.patch\n", r"series:1: a PR header is"),
                        ("# PR x: one\n# PR x: two\n", r"series:2: a second header for PR x"),
                        ("# PR x: t\nx/01-a.patch\n# late\n", r"series:3: a comment between the patches of PR x")):
        (d / "series").write_text(text)
        with pytest.raises(patches.PatchError, match=error):
            patches.series(d)


def test_patch_names_are_short_words_of_the_subject() -> None:
    assert patches.patch_stem("ggml : add GGML_TYPE_S3D8 type traits, validation and quantization") == \
        "ggml-add-GGML_TYPE_S3D8-type-traits-validation"  # cut at a word, no dangling "and"
    assert patches.patch_stem("llama, mtmd : validate slice-quantized tensors at load") == \
        "llama-mtmd-validate-slice-quantized-tensors-at-load"
    assert patches.patch_stem("convert : write mllama's max_image_tiles") == "convert-write-mllama-max_image_tiles"
    assert patches.patch_stem("llama : add LLAMA_FTYPE_MOSTLY_Q4_HQQ(_128) and llama-quantize support") == \
        "llama-add-LLAMA_FTYPE_MOSTLY_Q4_HQQ-128"  # "(_128)": no stray underscore
    assert all(len(patches.name(p)) <= 75 for p in patches.series())


def test_apply_refuses_to_destroy_uncommitted_work(tmp_path: Path, pinned_tree: Path) -> None:
    series = new_series(tmp_path)
    tree = patches.apply(tmp_path / "tree", series)
    (tree / "README.md").write_text("local edit")
    with pytest.raises(patches.PatchError, match="uncommitted changes"):
        patches.apply(tree, series)
    with pytest.raises(patches.PatchError, match="uncommitted changes"):
        patches.export(tree, series)
    # sync keeps a tree with local work and says so, also when the series changed meanwhile
    assert patches.sync(tree, series) == "up to date, with uncommitted local changes"
    other = patches.apply(tmp_path / "other", series)
    commit_change(other, "docs : a note", lambda t: (t / "NOTE.md").write_text("note\n"))
    patches.export(other, series)
    assert patches.sync(tree, series).startswith("KEPT")
    assert (tree / "README.md").read_text() == "local edit"
    patches.apply(tree, series, force=True)
    assert patches.sync(tree, series) == "up to date"


def test_sync_reapplies_a_stale_clean_tree(tmp_path: Path, pinned_tree: Path) -> None:
    series = new_series(tmp_path)
    tree = tmp_path / "tree"
    assert patches.sync(tree, series) == "applied"
    assert patches.sync(tree, series) == "up to date"
    # another developer's series arrives: a tree without local work follows it
    other = patches.apply(tmp_path / "other", series)
    commit_change(other, "docs : a note", lambda t: (t / "NOTE.md").write_text("note\n"))
    patches.export(other, series)
    assert patches.sync(tree, series) == "re-applied (series changed)"
    assert (tree / "NOTE.md").read_text() == "note\n"


def test_enum_parser_sees_live_and_removed_types(pinned_tree: Path) -> None:
    values = check_upstream.enum_values((pinned_tree / check_upstream.GGML_H).read_text())
    assert values[0] == "GGML_TYPE_F32" and values[42] == "GGML_TYPE_Q2_0"
    assert values[4] == "GGML_TYPE_Q4_2"  # removed, commented out, still reserved
    assert 43 not in values  # COUNT is not a type


def test_type_id_collision_is_detected(tmp_path: Path, pinned_tree: Path) -> None:
    series = new_series(tmp_path)
    tree = patches.apply(tmp_path / "tree", series)

    def add_type(t: Path) -> None:
        declare_type(t / "ggml/include/ggml.h", "GGML_TYPE_MINE    = 96")
    commit_change(tree, "ggml : add GGML_TYPE_MINE", add_type)
    patches.export(tree, series)
    assert check_upstream.check_ids(pinned_tree, series) == []
    # an upstream that has meanwhile taken 96 for something else
    fake = tmp_path / "upstream-later"
    shutil.copytree(pinned_tree, fake, symlinks=True)
    h = fake / check_upstream.GGML_H
    h.chmod(0o644)
    declare_type(h, "GGML_TYPE_NEW     = 96")
    assert check_upstream.check_ids(fake, series) == ["GGML_TYPE_MINE = 96 collides with upstream's GGML_TYPE_NEW"]


def test_the_committed_series_round_trips_and_has_no_collision(pinned_tree: Path) -> None:
    patches.check(patches.PATCH_DIR)
    assert check_upstream.check_ids(pinned_tree, patches.PATCH_DIR) == []


def test_check_upstream_reports_drift_and_failures_against_another_tree(tmp_path: Path, pinned_tree: Path) -> None:
    """A second upstream checkout where the code the patches touch moved or changed."""
    series = new_series(tmp_path)
    tree = patches.apply(tmp_path / "tree", series)

    def replace(old: str, new: str, path: str = "ggml/include/ggml.h"):
        return lambda t: (t / path).write_text((t / path).read_text().replace(old, new))
    commit_change(tree, "docs : touch the README", append("README.md", "\nS3D8 line\n"))
    commit_change(tree, "ggml : add a type", replace("GGML_TYPE_COUNT   = 43,", "GGML_TYPE_S3D8x   = 96,\n        GGML_TYPE_COUNT   = 97,"))
    patches.export(tree, series)
    other = tmp_path / "other-upstream"
    patches.make_base(other)
    # upstream appends to the README (the patch's context moves) and adds a type of its own (the very line
    # the second patch edits changes)
    append("README.md", "upstream's own new last line\n")(other)
    replace("GGML_TYPE_COUNT   = 43,", "GGML_TYPE_Q3_0    = 43,\n        GGML_TYPE_COUNT   = 44,")(other)
    patches.git(other, "commit", "-qam", "upstream moves on", env=IDENT)
    commit = upstream.resolve_checkout(other)
    [pinned, later] = check_upstream.run_checks([upstream.PIN, commit], series, pinned_tree, False, None)
    assert pinned.ok and [s for _, s, _ in pinned.patch_status] == ["clean", "clean"]
    assert [s for _, s, _ in later.patch_status] == ["drift", "FAILS"]
    assert later.drifted_files == ["README.md", "ggml/include/ggml.h"]
    assert not later.ok
    assert check_upstream.main(["--patches", str(series), "--against", str(other)]) == 1
    assert check_upstream.main(["--patches", str(series)]) == 0


def test_build_reconfigures_when_the_presets_change(tmp_path: Path) -> None:
    """ci/build.sh configures a new build folder once, then only builds, and configures again when the presets
    (or toolchain files) differ from those the folder was configured with (a changed preset, e.g. a cross preset
    that now builds the phone-path tools and links statically, must reach existing build folders)."""
    preset = f"test-stamp-{tmp_path.name}"
    calls = tmp_path / "calls"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "cmake").write_text(f"""#!/bin/sh
echo "$*" >> {calls}
if [ "$1" = "--preset" ]; then mkdir -p build/$2 && : > build/$2/CMakeCache.txt; fi
""")
    (fake / "cmake").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}

    def build() -> list[str]:
        calls.unlink(missing_ok=True)
        subprocess.run(["bash", str(REPO / "ci/build.sh"), preset], check=True, env=env, capture_output=True)
        return [line.split()[0] for line in calls.read_text().splitlines()]

    try:
        assert build() == ["--preset", "--build"]
        assert build() == ["--build"]
        (REPO / "build" / preset / ".s3d8-presets.sha256").write_text("configured with other presets\n")
        assert build() == ["--preset", "--build"]
        assert build() == ["--build"]
    finally:
        shutil.rmtree(REPO / "build" / preset, ignore_errors=True)


def test_lint_step_counts_each_tool_and_fails_on_a_finding(tmp_path: Path, monkeypatch, capsys) -> None:
    """ci/lint.py writes one JUnit case per tool; a tool that reports (non-zero exit) fails its case with its
    output, and ci/summarize.py counts that as a failure."""
    finding = [sys.executable, "-c", "print('x.py:1:1: F821 Undefined name `y`'); raise SystemExit(1)"]
    monkeypatch.setattr(lint, "CHECKS", {"clean": [sys.executable, "-c", "pass"], "finds": finding})
    assert lint.main(["--junitxml", str(tmp_path / "lint.xml")]) == 1
    xml = (tmp_path / "lint.xml").read_text()
    assert 'name="clean"' in xml and "F821 Undefined name" in xml
    assert summarize.main(tmp_path) == 1
    assert capsys.readouterr().out.strip().endswith("1 passed, 1 failed")


def test_summary_reports_step_times_and_the_slowest_cases(tmp_path: Path, capsys) -> None:
    """ci/test.sh's timings.tsv and the JUnit case times are printed, slowest first, without changing the count."""
    (tmp_path / "timings.tsv").write_text("setup\t12\npytest\t300\n")
    (tmp_path / "pytest.xml").write_text(
        '<testsuite><testcase classname="a" name="fast" time="0.5"/><testcase classname="a" name="slow" time="42.0"/>'
        '</testsuite>')
    assert summarize.main(tmp_path) == 0
    out = capsys.readouterr().out
    assert "time per step (total 312 s)" in out and "pytest:    300 s" in out
    assert out.index("a::slow") < out.index("a::fast")
    assert out.strip().endswith("2 passed, 0 failed")


def test_python_layers_import_graph_is_one_way() -> None:
    """tools/import_graph.py: every import (lazy ones too) of gguf_s3d8/, convert/ and qat/; a cycle and an upward
    edge are found on a made-up graph, and the real graph has neither: gguf_s3d8 < convert < qat, convert imports
    nothing of qat (the QAT student reaches the converter as a qat.export tensor file), nothing imports tests."""
    sys.path.insert(0, str(REPO / "tools"))
    import import_graph  # type: ignore[import-not-found]  # tools/ is put on sys.path above

    assert import_graph.LAYERS == ("gguf_s3d8", "convert", "qat")
    assert import_graph.cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]
    made_up = {("convert.to_gguf", "qat.gptq_s3d8"), ("qat.student", "convert.upstream_source"),
               ("gguf_s3d8.x", "convert.errors"), ("qat.tiny", "tests.mllama.tiny_model"), ("qat.a", "gguf_s3d8.b")}
    assert import_graph.upward(made_up) == [("convert.to_gguf", "qat.gptq_s3d8"), ("gguf_s3d8.x", "convert.errors"),
                                            ("qat.tiny", "tests.mllama.tiny_model")]
    graph = import_graph.edges()
    assert ("qat.export", "convert.upstream_source") in graph
    assert import_graph.upward(graph) == []
    assert not any(a.startswith("convert") and b.startswith("qat") for a, b in graph)
    assert import_graph.cycles(graph) == []
    assert not any(b.startswith("qat") for b in import_graph.reachable(graph, "convert.to_gguf"))
    assert import_graph.main(["--check"]) == 0


def test_rebase_moves_the_series_onto_another_tree(tmp_path: Path, pinned_tree: Path) -> None:
    """`patches.py rebase` replays the series onto another upstream tree with three-way merges: a patch whose
    context upstream changed (which `git am` refuses on a fresh tree) lands, and a real conflict stops with the
    patch and the file named, in `git rebase`'s state."""
    series = new_series(tmp_path)
    tree = patches.apply(tmp_path / "tree", series)

    def edit_line(path: str, n: int, text: str):
        def edit(t: Path) -> None:
            lines = (t / path).read_text().splitlines(keepends=True)
            lines[n] = text + "\n"
            (t / path).write_text("".join(lines))
        return edit
    commit_change(tree, "docs : our line", edit_line("README.md", 4, "our line"))
    commit_change(tree, "ggml : our header line", edit_line("ggml/include/ggml.h", 5, "// ours"))
    patches.export(tree, series)
    # another upstream tree: the README line just before ours changed (same hunk context), and the very header
    # line our second patch edits
    other = tmp_path / "other-upstream"
    patches.make_base(other)
    edit_line("README.md", 1, "upstream's line")(other)
    edit_line("ggml/include/ggml.h", 5, "// theirs")(other)
    patches.git(other, "commit", "-qam", "upstream moves on", env=IDENT)
    commit = upstream.resolve_checkout(other)
    with pytest.raises(patches.PatchError, match=r'"ggml : our header line" conflicts with .* ggml/include/ggml.h'):
        patches.rebase(tree, commit)
    lines = (tree / "README.md").read_text().splitlines()
    assert (lines[1], lines[4]) == ("upstream's line", "our line")  # 3 lines apart: in one hunk's context
    # resolve as a maintainer would, continue, export: the series now applies to the other tree
    edit_line("ggml/include/ggml.h", 5, "// ours, after theirs")(tree)
    patches.git(tree, "add", "-A")
    patches.git(tree, "-c", "core.editor=true", "rebase", "--continue")
    assert patches.base_ref(tree) == commit
    patches.export(tree, series)
    again = patches.apply(tmp_path / "again", series, ref=commit)
    assert (again / "ggml/include/ggml.h").read_text().splitlines()[5] == "// ours, after theirs"


def test_a_type_id_of_a_neighbour_tree_fails_unless_documented(monkeypatch, tmp_path: Path) -> None:
    """ik_llama.cpp (a neighbour) uses 97-99 for in-memory types: documented; any other shared id fails."""
    series = tmp_path / "series"
    series.mkdir()
    (series / "series").write_text("# PR x: one patch\nx.patch\n")
    (series / "x.patch").write_text("diff --git a/ggml/include/ggml.h b/ggml/include/ggml.h\n--- a/ggml/include/ggml.h\n"
                                    "+++ b/ggml/include/ggml.h\n@@ -1 +1,3 @@\n+        GGML_TYPE_MINE = 97,\n"
                                    "+        GGML_TYPE_OTHER = 120,\n")
    enum = "enum ggml_type {\n        GGML_TYPE_Q8_0_X4 = 97,\n        GGML_TYPE_R4 = {},\n        GGML_TYPE_COUNT,\n};\n"
    monkeypatch.setattr(upstream, "neighbour_file", lambda name, path: enum.replace("{}", "121"))
    bad, known = check_upstream.neighbour_collisions(series)
    assert bad == [] and known[0].startswith("GGML_TYPE_MINE = 97 is ik_llama.cpp's GGML_TYPE_Q8_0_X4 (deliberate:")
    monkeypatch.setattr(upstream, "neighbour_file", lambda name, path: enum.replace("{}", "120"))
    bad, _ = check_upstream.neighbour_collisions(series)
    assert bad == ["GGML_TYPE_OTHER = 120 is ik_llama.cpp's GGML_TYPE_R4"]


def test_sync_tree_gives_rewritten_files_a_new_time(tmp_path: Path) -> None:
    """ci/check_prs.py's tree sync: unchanged files keep their time (ninja rebuilds nothing for them), a file put
    back to the pin's older version is newer than anything built before (found when the fixes prefix ran after the
    s3d8 one: ggml-quants.c went back to the pin with the sdist's time and its S3D8 object was linked)."""
    import check_prs
    src, dest = tmp_path / "src", tmp_path / "dest"
    (src / "d").mkdir(parents=True)
    (src / "d" / "same.c").write_text("same\n")
    (src / "d" / "back.c").write_text("pin\n")
    for f in ("same.c", "back.c"):
        os.utime(src / "d" / f, (1e9, 1e9))  # the sdist's old times
    (dest / "d").mkdir(parents=True)
    (dest / "d" / "same.c").write_text("same\n")
    (dest / "d" / "back.c").write_text("patched\n")
    (dest / "d" / "gone.c").write_text("a patch's new file\n")
    os.utime(dest / "d" / "same.c", (2e9, 2e9))
    built = time.time() - 1
    check_prs.sync_tree(src, dest)
    assert sorted(p.name for p in (dest / "d").iterdir()) == ["back.c", "same.c"]
    assert (dest / "d" / "back.c").read_text() == "pin\n" and (dest / "d" / "back.c").stat().st_mtime >= built
    assert (dest / "d" / "same.c").stat().st_mtime == 2e9


def test_generated_models_of_another_prefix_are_cleared(tmp_path: Path) -> None:
    """ci/check_prs.py empties test-generate-models' folder before a prefix's tests: a model that a longer prefix
    wrote there (an architecture this prefix does not know) failed both state tests of the fixes prefix."""
    import check_prs
    models = tmp_path / "llama.cpp" / "tests" / "test-models"
    models.mkdir(parents=True)
    (models / "mllama-dense.gguf").write_bytes(b"GGUF")
    (models / "notes.txt").write_text("kept\n")
    check_prs.clear_generated_models(tmp_path)
    assert sorted(p.name for p in models.iterdir()) == ["notes.txt"]
    check_prs.clear_generated_models(tmp_path / "no-build-yet")  # nothing to clear


def test_the_prs_partition_the_series() -> None:
    """ci/check_prs.py: every patch of the series belongs to exactly one PR, in the order upstream merges them
    (fixes, S3D8 with its GPTQ, mllama, KV types, the CPU flash-attention kernel and the vector GELU-erf, then S3D8
    on Vulkan), and no fix names our types or architecture; the two CPU kernel PRs are one patch each that names
    none of them either, and the Vulkan PR starts with its headers guard, which names none of them."""
    import check_prs
    plan = check_prs.prefixes()
    assert [pr.name for pr, _ in plan] == ["fixes", "s3d8", "mllama", "kv-types", "cpu-fa", "cpu-gelu", "vulkan-s3d8"]
    vulkan = plan[-1][1][len(plan[-2][1]):]
    assert [patches.name(p) for p in vulkan] == [
        "vulkan-s3d8/01-ggml-vulkan-build-with-Vulkan-headers-older.patch",
        "vulkan-s3d8/02-ggml-vulkan-add-S3D8-MUL_MAT-MUL_MAT_ID-and-GET_ROWS.patch",
        "vulkan-s3d8/03-tests-S3D8-cases-at-k-4096-and-with-slices-of-odd.patch"]
    assert plan[-1][0].vulkan and not any(pr.vulkan for pr, _ in plan[:-1])
    guard = "\n".join(ln for ln in vulkan[0].read_text().splitlines() if ln.startswith("+"))
    assert "S3D8" not in guard and "s3d8" not in guard
    s3d8 = [patches.name(p) for p in plan[1][1][len(plan[0][1]):]]
    assert s3d8[0].startswith("s3d8/01-ggml-add-GGML_TYPE_S3D8") and s3d8[-4:] == [
        "s3d8/09-ggml-S3D8-GPTQ-with-given-Hessian.patch",
        "s3d8/10-imatrix-save-xtx-saves-each-weight-input-X-T-X.patch",
        "s3d8/11-llama-quantize-hessian-runs-GPTQ-for-S3D8-tensors.patch",
        "s3d8/12-llama-quantize-S3D8-file-type-gives-last-block.patch"]
    assert plan[1][0].checks == (("./test-backend-ops", "test", "-b", "CPU", "-p", "s3d8"),)
    for i in (-2, -3):
        assert len(plan[i][1]) - len(plan[i - 1][1]) == 1
        added = "\n".join(ln for ln in plan[i][1][-1].read_text().splitlines() if ln.startswith("+"))
        for word in ("S3D8", "s3d8", "HQQ", "TQ3_0", "cross_attn"):
            assert word not in added, (plan[i][0].name, word)
    assert plan[-1][1] == patches.series()
    start = 0
    for pr, prefix in plan:
        assert {p.parent.name for p in prefix[start:]} == {pr.name}  # a PR's patches are its folder's
        start = len(prefix)
    fixes = plan[0][1]
    for p in fixes:
        added = "\n".join(ln for ln in p.read_text().splitlines() if ln.startswith("+") or ln.startswith("Subject"))
        for word in ("S3D8", "s3d8", "mllama", "HQQ", "TQ3_0", "cross_attn"):
            assert word not in added, (p.name, word)


def test_check_prs_takes_the_prs_from_series(tmp_path: Path, monkeypatch) -> None:
    """ci/check_prs.py's partition is series' groups (each PR's prefix ends with its last patch); its checks and
    Vulkan flag are keyed by a PR's name there; a PR without patches, a key naming no PR of series and a patch
    outside any PR fail clearly."""
    import check_prs
    d = new_series(tmp_path, text="# PR fixes: fixes\nfixes/01-a.patch\nfixes/02-b.patch\n\n"
                                  "# PR s3d8: the type\ns3d8/01-c.patch\n\n# PR vulkan-s3d8: on Vulkan\n"
                                  "vulkan-s3d8/01-d.patch\n")
    for n in ("fixes/01-a", "fixes/02-b", "s3d8/01-c", "vulkan-s3d8/01-d"):
        (d / f"{n}.patch").parent.mkdir(exist_ok=True)
        (d / f"{n}.patch").write_text(n)
    monkeypatch.setattr(check_prs, "CHECKS", {k: v for k, v in check_prs.CHECKS.items() if k in ("s3d8", "vulkan-s3d8")})
    plan = check_prs.prefixes(d)
    assert [(pr.name, pr.title, pr.vulkan, bool(pr.checks), [patches.name(p, d) for p in prefix])
            for pr, prefix in plan] == [
        ("fixes", "fixes", False, False, ["fixes/01-a.patch", "fixes/02-b.patch"]),
        ("s3d8", "the type", False, True, ["fixes/01-a.patch", "fixes/02-b.patch", "s3d8/01-c.patch"]),
        ("vulkan-s3d8", "on Vulkan", True, True, ["fixes/01-a.patch", "fixes/02-b.patch", "s3d8/01-c.patch",
                                                  "vulkan-s3d8/01-d.patch"])]
    # the folder check_prs applies for a prefix is a series of its own
    subset = tmp_path / "subset"
    subset.mkdir()
    check_prs.write_prefix(plan[1][0], plan[1][1], subset, d)
    assert [patches.name(p, subset) for p in patches.series(subset)] == ["fixes/01-a.patch", "fixes/02-b.patch",
                                                                          "s3d8/01-c.patch"]
    kept = check_prs.CHECKS
    monkeypatch.setattr(check_prs, "CHECKS", {**kept, "gone": (("true",),)})
    with pytest.raises(patches.PatchError, match="CHECKS in ci/check_prs.py names PRs that series does not have: gone"):
        check_prs.prefixes(d)
    monkeypatch.setattr(check_prs, "CHECKS", kept)
    (d / "series").write_text((d / "series").read_text() + "\n# PR empty: nothing yet\n")
    with pytest.raises(patches.PatchError, match="PR empty has no patches"):
        check_prs.prefixes(d)
    (d / "series").write_text("fixes/01-a.patch\n" + (d / "series").read_text().replace("fixes/01-a.patch\n", ""))
    with pytest.raises(patches.PatchError, match="fixes/01-a.patch belongs to no PR"):
        check_prs.prefixes(d)


def test_summary_counts_every_kind_of_non_run_as_a_failure(tmp_path: Path, capsys) -> None:
    """The README's rule "a skipped test counts as a failure" for every way a case can not pass: a pytest skip, an
    error, a failure, and CTest's "Disabled" and "Not Run" cases (status attribute, with or without a <skipped>
    child); only the plain passed case and CTest's status="run" count as passed."""
    (tmp_path / "pytest.xml").write_text(
        '<testsuite>'
        '<testcase classname="t" name="passed"/>'
        '<testcase classname="t" name="skipped"><skipped message="no device"/></testcase>'
        '<testcase classname="t" name="errored"><error message="fixture"/></testcase>'
        '<testcase classname="t" name="failed"><failure message="assert"/></testcase>'
        '</testsuite>')
    (tmp_path / "ctest-host.xml").write_text(
        '<testsuite>'
        '<testcase name="ran" classname="ran" status="run"/>'
        '<testcase name="disabled" classname="disabled" status="disabled"><skipped message="Disabled"/></testcase>'
        '<testcase name="notrun" classname="notrun" status="notrun"/>'
        '</testsuite>')
    assert summarize.main(tmp_path) == 1
    out = capsys.readouterr().out
    assert out.strip().endswith("2 passed, 5 failed")
    for name in ("skipped", "disabled", "notrun"):
        assert "SKIPPED " in out and f"::{name}" in out, (name, out)


def test_conversion_cache_key_covers_the_patched_converter_and_gguf_py(tmp_path: Path, monkeypatch) -> None:
    """tests/mllama/harness.py caches conversions under a hash of what converts: a change to the patched tree's
    converter or gguf-py (a series patch, another pin) must give another key, as a change to convert/ does (issue 50,
    item 3: the key left the patches out, so a stale conversion survived a converter patch)."""
    from tests.mllama import harness

    tree = tmp_path / "work" / "llama.cpp"
    files = {tmp_path / "convert" / "to_gguf.py": "a", tmp_path / "gguf_s3d8" / "codec.py": "b",
             tree / "convert_hf_to_gguf.py": "c", tree / "gguf-py" / "gguf" / "constants.py": "d"}
    for f, text in files.items():
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    monkeypatch.setattr(harness, "REPO_ROOT", tmp_path)
    keys = {harness._code_hash()}
    for f in files:
        f.write_text(f.read_text() + "# changed")
        keys.add(harness._code_hash())
    assert len(keys) == 1 + len(files), "a converter input left out of the conversion cache key"
