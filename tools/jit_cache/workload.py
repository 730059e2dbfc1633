#!/usr/bin/env python3
"""Send a workload (jit_cache/workload.json) to a running SGLang server and time every request.

    python3 workload.py --workload FILE --url http://127.0.0.1:PORT [--wait-ready SECONDS] [--out TIMINGS.json]

Standard library only, and runnable as a plain script: it runs with the GPU host's image python,
which has neither this repository's tools/common nor any third-party package. So it reads and
checks the workload itself, and its errors are single lines ("error: ...", exit 2) by hand.

Each request goes to SGLang's native /generate with `input_ids` (the proof's server has no
tokenizer: --skip-tokenizer-init) and stream=True: time to first token is the time to the first
streamed chunk, total time the time to `data: [DONE]`. Steps run in order; a step's requests run
concurrently (one thread each). Prompts are drawn from the workload's seed, the step's name and
the request's index, so every run sends the same tokens.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Sequence

SCHEMA_VERSION = 1
FIX = "fix the entry (jit_cache/workload.json's description says what each field is)"
TOP_KEYS = {"schema_version", "description", "seed", "token_ids_below", "defaults", "steps", "skipped"}
STEP_KEYS = {"name", "why", "prompt_len", "concurrency", "sampling", "return_logprob", "top_logprobs_num"}
# SGLang SamplingParams fields a workload may set (sglang/srt/sampling/sampling_params.py), each
# with the JSON types it takes.
SAMPLING_TYPES: dict[str, tuple[type, ...]] = {
    "temperature": (int, float), "top_p": (int, float), "top_k": (int,), "min_p": (int, float),
    "max_new_tokens": (int,), "ignore_eos": (bool,), "repetition_penalty": (int, float),
    "frequency_penalty": (int, float), "presence_penalty": (int, float),
}
# A first chunk later than this is a hung server, not a slow compile.
REQUEST_TIMEOUT_S = 1800


class WorkloadError(Exception):
    """Bad input or an unreachable server: one line naming what and the fix."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sampling(where: str, sampling: Any) -> None:
    if not isinstance(sampling, dict):
        raise WorkloadError(f"{where}: must be an object of SGLang sampling parameters, got {sampling!r}; {FIX}")
    for key, value in sampling.items():
        types = SAMPLING_TYPES.get(key)
        if types is None:
            raise WorkloadError(f"{where}: unknown sampling parameter {key!r} (known: {', '.join(sorted(SAMPLING_TYPES))}); {FIX}")
        if isinstance(value, bool) != (types == (bool,)) or not isinstance(value, types):
            raise WorkloadError(f"{where}.{key}: {value!r} is not a {'/'.join(t.__name__ for t in types)}; {FIX}")


def check_workload(data: Any, where: str) -> dict[str, Any]:
    """`data` if it is a well-formed workload, else a WorkloadError naming the entry and field."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{where}: must be a JSON object; {FIX}")
    unknown, missing = set(data) - TOP_KEYS, {"schema_version", "seed", "token_ids_below", "steps"} - set(data)
    if unknown or missing:
        raise WorkloadError(f"{where}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; {FIX}")
    if data["schema_version"] != SCHEMA_VERSION:
        raise WorkloadError(f"{where}: schema_version {data['schema_version']!r}, this runner reads {SCHEMA_VERSION}; {FIX}")
    if not _is_int(data["seed"]):
        raise WorkloadError(f"{where}: seed must be an integer, got {data['seed']!r}; {FIX}")
    if not _is_int(data["token_ids_below"]) or data["token_ids_below"] < 2:
        raise WorkloadError(f"{where}: token_ids_below must be an integer above 1, got {data['token_ids_below']!r}; {FIX}")
    _check_sampling(f"{where} defaults", data.get("defaults", {}))
    steps = data["steps"]
    if not isinstance(steps, list) or not steps:
        raise WorkloadError(f"{where}: steps must be a non-empty list; {FIX}")
    names: set[str] = set()
    for i, step in enumerate(steps):
        at = f"{where} steps[{i}]"
        if not isinstance(step, dict):
            raise WorkloadError(f"{at}: must be an object, got {step!r}; {FIX}")
        name = step.get("name")
        if isinstance(name, str) and name:
            at = f"{at} ({name})"
        unknown, missing = set(step) - STEP_KEYS, {"name", "why", "prompt_len"} - set(step)
        if unknown or missing:
            raise WorkloadError(f"{at}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; {FIX}")
        if not isinstance(name, str) or not name or name in names:
            raise WorkloadError(f"{at}: name must be a non-empty string no other step has, got {name!r}; {FIX}")
        names.add(name)
        if not isinstance(step["why"], str) or not step["why"]:
            raise WorkloadError(f"{at}: why must say what the step exercises; {FIX}")
        for key in ("prompt_len", "concurrency"):
            if key in step and (not _is_int(step[key]) or step[key] < 1):
                raise WorkloadError(f"{at}: {key} must be a positive integer, got {step[key]!r}; {FIX}")
        if "return_logprob" in step and not isinstance(step["return_logprob"], bool):
            raise WorkloadError(f"{at}: return_logprob must be true or false, got {step['return_logprob']!r}; {FIX}")
        if "top_logprobs_num" in step and (not _is_int(step["top_logprobs_num"]) or step["top_logprobs_num"] < 0
                                           or not step.get("return_logprob")):
            raise WorkloadError(f"{at}: top_logprobs_num must be a non-negative integer, with return_logprob true; {FIX}")
        _check_sampling(f"{at} sampling", step.get("sampling", {}))
    for i, skipped in enumerate(data.get("skipped", [])):
        if not isinstance(skipped, dict) or set(skipped) != {"name", "why"} or not all(
                isinstance(v, str) and v for v in skipped.values()):
            raise WorkloadError(f"{where} skipped[{i}]: must be {{\"name\", \"why\"}} with non-empty strings; {FIX}")
    return data


class _DuplicateKey(ValueError):
    pass


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def load_workload(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise WorkloadError(f"--workload {path}: cannot read it ({e.strerror or e}); pass jit_cache/workload.json") from None
    try:
        data = json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except _DuplicateKey as e:
        raise WorkloadError(f"--workload {path}: key {e.args[0]!r} given twice in one object (JSON keeps the "
                            f"last silently); {FIX}") from None
    except ValueError as e:
        raise WorkloadError(f"--workload {path}: not JSON ({e}); {FIX}") from None
    return check_workload(data, f"workload {path}")


def prompt_ids(workload: dict[str, Any], step: dict[str, Any], index: int) -> list[int]:
    """The request's prompt: the same ids on every run (seeded by workload seed, step, index)."""
    rng = random.Random(f"{workload['seed']}:{step['name']}:{index}")
    return [rng.randrange(1, workload["token_ids_below"]) for _ in range(step["prompt_len"])]


def request_body(workload: dict[str, Any], step: dict[str, Any], index: int) -> dict[str, Any]:
    """The /generate body of one request of `step` (GenerateReqInput, sglang/srt/managers/io_struct.py)."""
    body: dict[str, Any] = {
        "input_ids": prompt_ids(workload, step, index),
        "sampling_params": {**workload.get("defaults", {}), **step.get("sampling", {})},
        "stream": True,
    }
    if step.get("return_logprob"):
        body["return_logprob"] = True
        body["top_logprobs_num"] = step.get("top_logprobs_num", 0)
    return body


def send(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """POST a streaming /generate; the timings and what came back (never raises for the server's
    answer: a failed request is a row with its error)."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=data,
                                 headers={"Content-Type": "application/json"})
    out: dict[str, Any] = {"prompt_len": len(body["input_ids"]), "ttft_s": None, "total_s": None,
                           "output_tokens": None, "chunks": 0, "error": None}
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            last = None
            for raw in resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[len(b"data:"):].strip()
                if payload == b"[DONE]":
                    out["total_s"] = time.perf_counter() - start
                    break
                if out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - start
                out["chunks"] += 1
                last = json.loads(payload)
                if isinstance(last, dict) and last.get("error"):
                    out["error"] = str(last["error"])[:300]
            if isinstance(last, dict):
                meta = last.get("meta_info") or {}
                out["output_tokens"] = meta.get("completion_tokens", len(last.get("output_ids") or []))
                out["finish_reason"] = meta.get("finish_reason")
                if body.get("return_logprob"):
                    out["output_top_logprobs"] = len(meta.get("output_top_logprobs") or [])
    except urllib.error.HTTPError as e:
        out["error"] = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    if out["error"] is None and (out["ttft_s"] is None or out["total_s"] is None):
        out["error"] = "the stream ended without a chunk or without [DONE]"
    wanted = body["sampling_params"].get("max_new_tokens")
    if out["error"] is None and body["sampling_params"].get("ignore_eos") and wanted != out["output_tokens"]:
        # with ignore_eos a short answer means the server stopped the request itself
        out["error"] = f"{out['output_tokens']} output tokens of the {wanted} asked (finish {out.get('finish_reason')})"
    if out["total_s"] is None:
        out["total_s"] = time.perf_counter() - start
    return out


def _get_status(url: str) -> tuple[int | None, str]:
    """The HTTP status of a GET (None when nothing answered) and what to say about it."""
    try:
        with urllib.request.urlopen(url, timeout=30) as resp:
            return resp.status, f"answered {resp.status}"
    except urllib.error.HTTPError as e:
        return e.code, f"answered {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return None, str(getattr(e, "reason", e))


def wait_ready(url: str, seconds: float) -> float:
    """Seconds until the server generates (/health_generate answers 200; a server without that
    route: /get_model_info answers 200), or a WorkloadError naming what it last said."""
    base = url.rstrip("/")
    start = time.monotonic()
    while True:
        status, said = _get_status(base + "/health_generate")
        last = f"/health_generate {said}"
        if status == 200:
            return time.monotonic() - start
        if status == 404:
            status, said = _get_status(base + "/get_model_info")
            last = f"/health_generate answered 404, /get_model_info {said}"
            if status == 200:
                return time.monotonic() - start
        if time.monotonic() - start > seconds:
            raise WorkloadError(f"--url {url}: not ready after {seconds:.0f} s ({last}); check the server's log, "
                                "or raise --wait-ready")
        time.sleep(2)


def run_step(url: str, workload: dict[str, Any], step: dict[str, Any]) -> list[dict[str, Any]]:
    count = step.get("concurrency", 1)
    rows: list[dict[str, Any] | None] = [None] * count

    def one(index: int) -> None:
        rows[index] = {"step": step["name"], "index": index,
                       **send(url, request_body(workload, step, index))}

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [row for row in rows if row is not None]


def table(rows: Sequence[dict[str, Any]]) -> str:
    def sec(value: Any) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [f"{'step':<16} {'#':>3} {'prompt':>7} {'ttft_s':>9} {'total_s':>9} {'out':>4}  error"]
    for r in rows:
        lines.append(f"{r['step']:<16} {r['index']:>3} {r['prompt_len']:>7} {sec(r['ttft_s']):>9} "
                     f"{sec(r['total_s']):>9} {'-' if r['output_tokens'] is None else r['output_tokens']:>4}  "
                     f"{r['error'] or ''}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", type=Path, required=True, help="jit_cache/workload.json")
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--wait-ready", type=float, default=0, metavar="SECONDS",
                        help="poll /health_generate this long before sending (0: send at once)")
    parser.add_argument("--out", type=Path, help="write the timings here as JSON")
    args = parser.parse_args(argv)
    try:
        workload = load_workload(args.workload)
        ready_s = wait_ready(args.url, args.wait_ready) if args.wait_ready > 0 else None
    except WorkloadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for skipped in workload.get("skipped", []):
        print(f"skipped {skipped['name']}: {skipped['why']}")
    rows: list[dict[str, Any]] = []
    step_times = []
    for step in workload["steps"]:
        start = time.perf_counter()
        rows.extend(run_step(args.url, workload, step))
        step_times.append({"step": step["name"], "requests": step.get("concurrency", 1),
                           "wall_s": time.perf_counter() - start})
    print(table(rows))
    failed = [r for r in rows if r["error"]]
    if args.out is not None:
        result = {"url": args.url, "workload": str(args.workload), "ready_s": ready_s,
                  "skipped": workload.get("skipped", []), "steps": step_times, "requests": rows,
                  "failed": len(failed)}
        try:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        except OSError as e:
            print(f"error: --out {args.out}: cannot write ({e.strerror or e}); pass a writable path", file=sys.stderr)
            return 2
        print(f"timings: {args.out}")
    if failed:
        print(f"error: {len(failed)} of {len(rows)} requests failed (first: {failed[0]['step']}#{failed[0]['index']}: "
              f"{failed[0]['error']})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
