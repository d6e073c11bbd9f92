"""ci/mutants.py, the mutation check (docs/reliability.md, "Mutation check"): its list follows the code, a mutant is
applied and restored byte for byte, the daily draw is reproducible, and ci/summarize.py counts a survivor as a
failure. (The mutants themselves run in `python3 ci/mutants.py`, and five of them in every CI run: ci/test.sh.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ci"))
import mutants as M  # noqa: E402
import summarize  # noqa: E402


def test_every_mutant_names_one_line_of_the_code() -> None:
    """Each mutant's line occurs exactly once and its replacement nowhere (so that restoring it is unambiguous):
    a change to the code that moves such a line fails here, in every CI run, not in the next mutation run."""
    for m in M.MUTANTS:
        text = (M.REPO / m.path).read_text()
        assert text.count(m.old) == 1, f"{m.id}: its line occurs {text.count(m.old)} times in {m.path}"
        assert m.new not in text, f"{m.id}: its replacement is already in {m.path}"
        assert m.old != m.new and m.suite in M.SUITES, m.id


def test_the_list_covers_what_it_must() -> None:
    ids = [m.id for m in M.MUTANTS]
    assert len(ids) == len(set(ids)) >= 40
    # the kinds of fault the issue names, each at least once
    for prefix in ("cpu-decode", "cpu-gemm-triple", "cpu-act-round", "cpu-epilogue-order", "validate-", "gguf-",
                   "mtmd-", "clip-", "cross-mask", "hqq-scale", "hqq-zero", "fa-kv-tile", "gptq-update-sign",
                   "imatrix-xtx-columns", "vk-", "py-"):
        assert any(i.startswith(prefix) for i in ids), prefix
    assert {m.suite for m in M.MUTANTS} == set(M.SUITES)


def test_apply_and_restore_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(M, "REPO", tmp_path)
    f = tmp_path / "x.c"
    original = "int a = 1;\nint b = a + 1;\n"
    f.write_text(original)
    m = M.Mutant("t", "x.c", "a + 1", "a - 1", "codec", "test")
    M.apply(m, True)
    assert f.read_text() == "int a = 1;\nint b = a - 1;\n"
    f.write_text(f.read_text() + "// an edit elsewhere while mutated\n")
    M.apply(m, False)
    assert f.read_text() == original + "// an edit elsewhere while mutated\n"
    with pytest.raises(M.Stale, match="occurs 0 times"):
        M.apply(M.Mutant("gone", "x.c", "no such line", "x", "codec", "test"), True)


def test_the_daily_draw_is_reproducible() -> None:
    a, b = M.draw(20261207, 5), M.draw(20261207, 5)
    assert [m.id for m in a] == [m.id for m in b] and len({m.id for m in a}) == 5
    assert len({tuple(m.id for m in M.draw(seed, 5)) for seed in range(20261201, 20261208)}) > 1


def test_a_survivor_fails_the_summary(tmp_path: Path) -> None:
    results = [{"id": "a", "what": "x", "result": "killed", "seconds": 1.0},
               {"id": "b", "what": "y", "result": "survived", "seconds": 2.0}]
    M.write_junit(tmp_path / "mutants.xml", results, [])
    assert summarize.main(tmp_path) == 1
    M.write_junit(tmp_path / "mutants.xml", results[:1], [])
    assert summarize.main(tmp_path) == 0
    M.write_junit(tmp_path / "mutants.xml", results[:1], ["c: the line occurs 0 times"])
    assert summarize.main(tmp_path) == 1
