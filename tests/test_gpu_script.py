"""benchmarks/gpu.py: its dry run (every stage on CPU with tiny settings), reached the way a bare GPU machine reaches it
(gpu_payload.py's parts, gpu_device.sh), writes every stage's status in order; benchmarks/gpu_tables.py turns a result
file into the docs' GPU tables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_tables  # noqa: E402

STATUSES = {"passed", "failed", "skipped", "timed out"}


def test_dry_run_from_a_payload_through_the_device_script(tmp_path):
    """The path a bare GPU machine takes, on CPU: the payload in parts, joined and unpacked by gpu_device.sh, which
    runs gpu.py's dry run (every stage, tiny settings) and packs the results folder into one tar file."""
    import gpu_payload

    start = time.perf_counter()
    parts = gpu_payload.build(tmp_path / "parts", [], [], None, size=100, level=1)
    assert len(parts) > 1 and all(p.stat().st_size <= 100 for p in parts)
    env = {**os.environ, "PARTS": str(tmp_path / "parts"), "PAYLOAD": str(tmp_path / "payload"),
           "PYTHON": sys.executable, "RESULTS": str(tmp_path / "gpu"), "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_device.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "payload" / "site").is_dir() and "gpu.py exited 0" in done.stdout
    with tarfile.open(tmp_path / "out" / "gpu-results.tar") as tar:
        tar.extractall(tmp_path / "back")
    [path] = (tmp_path / "back" / "gpu").glob("*.json")
    report = json.loads(path.read_text())
    assert report["dry_run"] and list(report["stages"]) == ["llm_scale", "tests", "speed_memory", "finetune"]
    llm = report["stages"]["llm_scale"]
    assert llm["status"] == "passed" and llm["results"]["passed"] == llm["results"]["rows"] == 3  # non-private, the default and per-layer clipping
    assert all(s["status"] in STATUSES and s["seconds"] >= 0 for s in report["stages"].values())
    tests = report["stages"]["tests"]["results"]["tests"]
    assert tests and set(tests.values()) == {"skipped"}  # the gpu tests skip without CUDA (parsed from junit XML)
    assert "tests.test_gpu::test_cuda_run_predicts_and_exports" in tests
    speed = report["stages"]["speed_memory"]
    assert speed["status"] == "passed" and speed["results"][0]["rows"][0]["examples_per_s"] > 0
    profiles = {p["step"]: p for p in speed["results"][0]["profiles"]}  # one profiled step per variant
    assert profiles["dpl"]["kernels"] > profiles["non-private"]["kernels"] > 0 and profiles["dpl"]["top"]
    finetune = report["stages"]["finetune"]
    assert finetune["status"] == "passed" and finetune["results"]["remaining"] == 0
    assert (tmp_path / "back" / "gpu" / "finetune" / "finetune_ftrl_quick.json").is_file()
    print(f"dry run: {time.perf_counter() - start:.0f} s")


def test_payload_parts_fit_beside_the_repository():
    """Each part and the repository's files together stay under one command's limit; the wheels cover what the
    GPU machine's image lacks, pinned at the versions installed here."""
    import gpu_payload

    size = gpu_payload.part_bytes()
    assert 0 < size and size + gpu_payload.repository_bytes() < gpu_payload.LIMIT_MIB * 2 ** 20
    pins = gpu_payload.pinned(gpu_payload.WHEELS)
    assert {"opacus", "prv-accountant", "cryptography", "cffi"} <= {p.split("==")[0] for p in pins}
    assert all(p.split("==")[1] for p in pins)


def test_junit_failures_keep_the_message(tmp_path):
    import gpu

    xml = tmp_path / "junit.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="test_b"><failure message="'
                   'AssertionError: 1 != 2">trace</failure></testcase><testcase classname="tests.test_a" '
                   'name="test_c"/></testsuite></testsuites>')
    assert gpu.junit_failures(xml) == {"tests.test_a::test_b": "AssertionError: 1 != 2\ntrace"}
    assert gpu.junit_results(xml) == {"tests.test_a::test_b": "failed", "tests.test_a::test_c": "passed"}


def synthetic_report() -> dict:
    row = {"model": "minilm", "step": "dpl", "median_s": 0.0125, "examples_per_s": 2560.0, "x_nonprivate": 1.37,
           "peak_memory_gib": 1.234}
    return {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-25", "dry_run": False, "budget_seconds": 480,
            "stages": {"tests": {"status": "failed", "seconds": 61.0, "results": {
                "counts": {"passed": 5, "failed": 1, "skipped": 0},
                "tests": {"tests.test_gpu::test_cuda_run_predicts_and_exports": "failed"},
                "failures": {"tests.test_gpu::test_cuda_run_predicts_and_exports":
                             "assert 1 == 2\ntrace\nE   RuntimeError: no kernel image\nE   more`"}}},
                "speed_memory": {"status": "passed", "seconds": 150.0, "results": [
                    {"model": "minilm", "lora": True, "precision": "bf16", "batch": 64, "tokens": 256,
                     "status": "passed", "rows": [row]},
                    {"model": "minilm", "lora": True, "precision": "bf16", "batch": 64, "tokens": 256, "repeats": 1,
                     "profile": True, "status": "passed", "rows": [{**row, "examples_per_s": 1.0}],
                     "profiles": [{"model": "minilm", "step": "dpl", "kernels": 1234, "unit": "CUDA kernels",
                                   "top": [{"name": "ampere_sgemm", "ms": 1.5, "calls": 40}]}]}]},
                "finetune": {"status": "timed out", "seconds": 250.0, "results": {"chunks": [], "remaining": 3}}}}


def test_gpu_tables(tmp_path):
    docs = tmp_path / "benchmarks.md"
    docs.write_text(f"# Benchmarks\n\n## GPU\n\n{gpu_tables.BEGIN}\nold\n{gpu_tables.END}\n\nafter\n")
    results = tmp_path / "gpu"
    results.mkdir()
    gpu_tables.main(["--results", str(results), "--docs", str(docs)])
    assert "No GPU run yet." in docs.read_text() and "old" not in docs.read_text()
    (results / "2026-11-25_nvidia-h100-80gb-hbm3.json").write_text(json.dumps(synthetic_report()))
    (results / "2026-11-25_cpu-2-cores.json").write_text(json.dumps({**synthetic_report(), "dry_run": True,
                                                                     "gpu": "CPU (2 cores)"}))
    gpu_tables.main(["--results", str(results), "--docs", str(docs)])
    text = docs.read_text()
    assert "No GPU run yet." not in text and "CPU (2 cores)" not in text and text.endswith("\nafter\n")
    assert "| 2026-11-25_nvidia-h100-80gb-hbm3.json | NVIDIA H100 80GB HBM3 | 480 | failed (61 s) | passed (150 s) | " \
           "timed out (250 s) |" in text
    assert "| 5 | 1 | 0 | tests.test_gpu::test_cuda_run_predicts_and_exports |" in text
    assert "* 2026-11-25_nvidia-h100-80gb-hbm3.json, `tests.test_gpu::test_cuda_run_predicts_and_exports`: `more'`" in text
    assert "| NVIDIA H100 80GB HBM3 | minilm | LoRA r=8 | bf16 | 64 x 256 | dpl | 2560.0 | 1.37 | 1.23 |" in text  # not the profiled run's
    assert "| NVIDIA H100 80GB HBM3 | minilm | dpl | 1234 | `ampere_sgemm` 1.50 (40) |" in text


def test_outcomes_of_a_test_run_stopped_at_its_timeout():
    """Without a junit XML (pytest killed at the stage's deadline), the outcomes come from the ``-v`` lines."""
    import gpu

    output = ("tests/test_noise.py::test_a PASSED [ 10%]\ntests/test_gpu.py::test_b[bf16-mixed] FAILED [ 20%]\n"
              "tests/test_fsdp.py::test_c SKIPPED (needs a CUDA GPU) [ 30%]\ntests/test_fsdp.py::test_d ")
    assert gpu.verbose_results(output) == {"tests.test_noise::test_a": "passed",
                                           "tests.test_gpu::test_b[bf16-mixed]": "failed",
                                           "tests.test_fsdp::test_c": "skipped"}


def test_a_speed_run_counts_as_done_only_on_the_same_sources(tmp_path):
    """After a change to dpl's sources the speed runs measure it again; the same sources skip what passed."""
    import argparse

    import gpu

    run = {"model": "minilm", "lora": False, "precision": "fp32", "batch": 32, "tokens": 128, "status": "passed"}
    for name, source in (("2026-01-01_h100.json", "old"), ("2026-01-02_h100.json", gpu.source_hash())):
        failed = {**run, "precision": "bf16", "status": "timed out"}
        (tmp_path / name).write_text(json.dumps({"source": source, "stages": {"speed_memory": {
            "results": [{**run, "batch": 64 if source == "old" else 32}, failed]}}}))
    done = gpu.earlier_speed_runs(argparse.Namespace(out=tmp_path, slug="h100", source=gpu.source_hash()))
    assert done == {gpu.speed_key(run)}
    assert gpu.earlier_speed_runs(argparse.Namespace(out=tmp_path, slug="h100", source="new")) == set()
