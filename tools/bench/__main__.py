"""The four times a newcomer meets, with their goals (not a test: it drives Bazel itself).

    python3 -m tools.bench [--only cold-tests,second-clone,warm-noop,main-after-tests,kernel-cache,cold-main,second-push,verify,both]
                           [--record docs/measurements/YYYY-MM-DD.md] [--keep] [--profiles] [--fresh-home]

Each figure runs a README command in a fresh clone of HEAD, as a newcomer would:

| figure        | what runs                                                      | goal                    |
|---------------|----------------------------------------------------------------|-------------------------|
| cold-tests    | `bash .ci/run` (the test command): new output root, empty disk cache | <= 12 min          |
| second-clone  | `bash .ci/run` in a second clone: new output root, the disk cache of cold-tests | <= 3 min |
| warm-noop     | `bash .ci/run` again in that clone, nothing changed             | <= 1 min                |
| main-after-tests | the main job in a new clone: new output root, the disk cache of cold-tests (the image's shared actions come from it) | (against cold-main) |
| kernel-cache  | `tools/bazel build --config=pypi //kernel_cache:sm120_cache`: new output root, empty disk cache | (the reference) |
| cold-main     | `tools/bazel run //image:push_pypi` (the main job): new output root, empty disk cache | kernel-cache + 3 min |
| second-push   | the main job again in the same clone: the image and its attachments already pushed | 0 blobs, 3 attachments kept |
| verify        | `tools/bazel run //image:verify -- REF --key PUB` on what the main job pushed (a full pull) | 6 of 6 checks ok |
| both          | the test command and the main job started together in two clones: two new output roots, one empty disk cache | both green |

"Cold" is Bazel cold: no output root and no disk cache (`KIMI_K3_BAZEL_OUTPUT_ROOT`,
`KIMI_K3_DISK_CACHE` point into a temp dir); the artifact cache (downloads, by sha256) and the
sealed Bazel root are kept, since they are the network's time, not the build's. --fresh-home
measures a newcomer's machine instead: HOME is a new directory under the temp dir (only the
user's pip configuration copied into it, which is the machine's set-up), so the figures also
download every input and provision the sealed root, the test venv and the artifact cache. Prints the table
with the date, the machine and the commit; --record appends it to a measurements file. Stops
each Bazel server and removes each output root when its figures are done (--keep keeps them).
Needs the disk room of one output root of the image and its disk cache (tens of GB): each
figure's output root and disk cache are removed when the figures that need them are done. The
main job leaves the local registry running, as it does for users (`python3 -m tools.image.push
--stop-local-registry` stops it); the registry may already hold some blobs. --profiles takes a
Bazel profile of each cold command and adds its top 15 actions and tests (tools/bench/profile.py).
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tools.bench.profile import report as profile_report
from tools.bench.runs import clone, machine, run, run_together, shutdown
from tools.common.errors import UserError, run_cli

REPO_ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("cold-tests", "second-clone", "warm-noop", "main-after-tests", "kernel-cache", "cold-main", "second-push", "verify", "both")
AFTER_MAIN = ("second-push", "verify")  # figures of what the main job pushed
GOALS = {"cold-tests": 12 * 60, "second-clone": 3 * 60, "warm-noop": 60}
MAIN_JOB_MARGIN = 3 * 60
MAIN_JOB = ["tools/bazel", "run", "//image:push_pypi"]  # README's main job
COUNT_RE = re.compile(r"^(\d+) passed, (\d+) failed", re.M)
ELAPSED_RE = re.compile(r"INFO: Elapsed time: ([\d.]+)s, Critical Path: ([\d.]+)s")
PROCESSES_RE = re.compile(r"INFO: (\d+ processes: [^\n]*?)\.?$", re.M)
DIGEST_RE = re.compile(r"(sha256:[0-9a-f]{64})")


@dataclass
class Figure:
    name: str
    command: str
    wall: float
    rc: int
    detail: str
    goal: str = ""
    met: bool | None = None


def tests_detail(output: str) -> str:
    counts = COUNT_RE.findall(output)
    return f"{counts[-1][0]} passed, {counts[-1][1]} failed" if counts else "no `N passed, N failed` line"


def build_detail(output: str) -> str:
    m = ELAPSED_RE.findall(output)
    crit = f"Bazel {float(m[-1][0]):.0f} s, critical path {float(m[-1][1]):.0f} s" if m else "no Bazel summary"
    manifest = re.findall(r"manifest digest:\s*(sha256:[0-9a-f]{64})", output)
    return crit + (f", manifest {manifest[-1][:19]}..." if manifest else "")


def after_main(cmd: Sequence[str], clone_dir: Path, env: dict[str, str], work: Path, only: Sequence[str],
               main_output: str) -> list[Figure]:
    """The main job once more (nothing to upload, every attachment kept), then verify what it pushed."""
    from tools.common.cache import cache_root
    from tools.image.signing import LOCAL_KEY_NAME

    figures = []
    if "second-push" in only:
        rc, secs, out = run(list(cmd), clone_dir, env, work / "main-again.log")
        up = re.findall(r"uploaded:\s+(\S+) of (\d+) blobs, (\S+) bytes", out)
        kept = len(re.findall(r"already there, kept", out))
        detail = (f"{up[-1][0]} of {up[-1][1]} blobs, {up[-1][2]} bytes; {kept} of 3 attachments kept" if up
                  else "no `uploaded:` line")
        figures.append(Figure("second-push", " ".join(cmd) + " (again)", secs, rc, detail, "0 blobs, 3 kept",
                              rc == 0 and bool(up) and up[-1][0] == "0" and kept == 3))
    if "verify" in only:
        refs = re.findall(r"^pushed:\s+(\S+@sha256:[0-9a-f]{64})", main_output, re.M)
        key = cache_root() / "signing" / f"{LOCAL_KEY_NAME}.pub"
        vcmd = ["tools/bazel", "run", "//image:verify", "--", refs[-1] if refs else "missing-ref", "--key", str(key)]
        rc, secs, out = run(vcmd, clone_dir, env, work / "verify.log")
        oks = len(re.findall(r"^ok ", out, re.M))
        figures.append(Figure("verify", "tools/bazel run //image:verify -- REF --key PUB", secs, rc,
                              f"{oks} of 6 checks ok", "6 of 6 ok", rc == 0 and oks == 6))
    return figures


# Where a run keeps what it provisions (tools/bazel, tools/common/cache.py): unset in a fresh HOME.
CACHE_VARIABLES = ("XDG_CACHE_HOME", "KIMI_K3_CACHE", "KIMI_K3_SEALED_ROOT_DIR")


def fresh_home_env(env: dict[str, str], home: Path) -> dict[str, str]:
    """`env` with HOME a new directory and every cache location derived from it. The user's pip
    configuration is copied in: it says where this machine's packages come from (set-up, not a
    cache), and a newcomer's HOME has it too."""
    home.mkdir(parents=True)
    config = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME", "~")).expanduser() / ".config") / "pip"
    if config.is_dir():
        shutil.copytree(config, home / ".config" / "pip")
    return {k: v for k, v in env.items() if k not in CACHE_VARIABLES and k != "XDG_CONFIG_HOME"} | {"HOME": str(home)}


def table(figures: Sequence[Figure], commit: str, fresh_home: bool = False) -> str:
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    state = ("a fresh HOME (every input downloaded, the sealed root provisioned)" if fresh_home
             else "the artifact cache and the sealed root kept")
    lines = [f"Commit {commit}, {when}, {machine()}, {state}.", "",
             "| figure | command | time | goal | met | detail |", "|---|---|---|---|---|---|"]
    for f in figures:
        met = "" if f.met is None else ("yes" if f.met else "**no**")
        rc = "" if f.rc == 0 else f" (exit {f.rc})"
        lines.append(f"| {f.name} | `{f.command}` | {f.wall:.0f} s{rc} | {f.goal} | {met} | {f.detail} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", default=",".join(FIGURES), help=f"comma-separated subset of {','.join(FIGURES)}")
    p.add_argument("--record", type=Path, help="append the table to this measurements file")
    p.add_argument("--keep", action="store_true", help="keep the clones and output roots")
    p.add_argument("--profiles", action="store_true",
                   help="take a Bazel profile of cold-tests and cold-main and print their top 15 actions")
    p.add_argument("--fresh-home", action="store_true",
                   help="a new HOME for the figures: no artifact cache, sealed root or venv (a newcomer's machine)")
    args = p.parse_args(argv)
    only = [f for f in args.only.split(",") if f]
    unknown = sorted(set(only) - set(FIGURES))
    if unknown:
        raise UserError(f"--only {args.only}: unknown figure(s) {unknown}; pick from {','.join(FIGURES)}")
    if set(AFTER_MAIN) & set(only) and "cold-main" not in only:
        raise UserError(f"--only {args.only}: {'/'.join(AFTER_MAIN)} measure what cold-main pushed; add cold-main")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    work = Path(tempfile.mkdtemp(prefix="kimi-k3-bench."))
    figures: list[Figure] = []
    profiles: list[str] = []

    def with_profile(figure: str, clone_dir: Path) -> None:
        # user.bazelrc (git-ignored, read after .bazelrc) reaches the README's command unchanged;
        # the file is in the clone because Bazel runs in the sealed root, which mounts the
        # workspace at its own path but not the bench's work directory.
        if args.profiles and figure in ("cold-tests", "cold-main"):
            # For the measured command only (`test` or `run`): another command, even `info`, would
            # write its own profile over it.
            cmd = "test" if figure == "cold-tests" else "run"
            (clone_dir / "user.bazelrc").write_text(
                f"{cmd} --profile={clone_dir / 'bench.profile.gz'}\n"
                f"{cmd} --experimental_profile_include_target_label\n{cmd} --noslim_profile\n")

    def read_profile(figure: str, clone_dir: Path) -> None:
        path = clone_dir / "bench.profile.gz"
        if args.profiles and path.is_file():
            profiles.append(f"### {figure}: the top actions and tests (`python3 -m tools.bench.profile`)\n\n"
                            + profile_report(path, 15, "target"))

    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("KIMI_K3_BAZEL_OUTPUT_ROOT", "KIMI_K3_DISK_CACHE"))}
    if args.fresh_home:
        base_env = fresh_home_env(base_env, work / "home")

    def env_for(name: str, disk: str) -> dict[str, str]:
        return base_env | {"KIMI_K3_BAZEL_OUTPUT_ROOT": str(work / f"out-{name}"),
                           "KIMI_K3_DISK_CACHE": str(work / f"disk-{disk}")}

    def drop(name: str, env: dict[str, str], disk: str | None = None) -> None:
        shutdown(work / name, env)
        if not args.keep:
            for d in [f"out-{name}"] + ([f"disk-{disk}"] if disk else []):
                subprocess.run(["rm", "-rf", "--one-file-system", str(work / d)], check=False)

    try:
        if {"cold-tests", "second-clone", "warm-noop", "main-after-tests"} & set(only):
            # The second clone needs the first one's disk cache, so the first always runs.
            for name, figure in (("tests-a", "cold-tests"), ("tests-b", "second-clone")):
                if figure == "second-clone" and not {"second-clone", "warm-noop"} & set(only):
                    break
                clone(work / name)
                with_profile(figure, work / name)
                env = env_for(name, "tests")
                rc, secs, out = run(["bash", ".ci/run"], work / name, env, work / f"{name}.log")
                read_profile(figure, work / name)
                if figure in only:
                    figures.append(Figure(figure, "bash .ci/run", secs, rc, tests_detail(out),
                                          f"<= {GOALS[figure] // 60} min", rc == 0 and secs <= GOALS[figure]))
                if figure == "second-clone" and "warm-noop" in only:
                    rc, secs, out = run(["bash", ".ci/run"], work / name, env, work / f"{name}-noop.log")
                    figures.append(Figure("warm-noop", "bash .ci/run (again)", secs, rc, tests_detail(out),
                                          f"<= {GOALS['warm-noop']} s", rc == 0 and secs <= GOALS["warm-noop"]))
                drop(name, env, "tests" if figure == "second-clone" else None)
                if figure == "cold-tests" and "main-after-tests" in only:
                    # A newcomer's second README command: what the disk cache of the first gives it.
                    clone(work / "after")
                    env = env_for("after", "tests")
                    rc, secs, out = run(MAIN_JOB, work / "after", env, work / "after.log")
                    processes = PROCESSES_RE.findall(out)
                    figures.append(Figure("main-after-tests", " ".join(MAIN_JOB), secs, rc,
                                          build_detail(out) + (f"; {processes[-1]}" if processes else "")))
                    drop("after", env)
        reference = None
        for figure, name, cmd in (("kernel-cache", "kc", ["tools/bazel", "build", "--config=pypi", "//kernel_cache:sm120_cache"]),
                                  ("cold-main", "main", MAIN_JOB)):
            if figure not in only:
                continue
            clone(work / name)
            with_profile(figure, work / name)
            env = env_for(name, name)
            rc, secs, out = run(cmd, work / name, env, work / f"{name}.log")
            read_profile(figure, work / name)
            goal, met = "", None
            if figure == "kernel-cache":
                reference = secs
            elif reference is not None:
                goal = f"<= {(reference + MAIN_JOB_MARGIN) / 60:.1f} min (kernel-cache + 3)"
                met = rc == 0 and secs <= reference + MAIN_JOB_MARGIN
            figures.append(Figure(figure, " ".join(cmd), secs, rc, build_detail(out), goal, met))
            if figure == "cold-main" and rc == 0:
                figures += after_main(cmd, work / name, env, work, only, out)
            drop(name, env, name)
        if "both" in only:
            # A newcomer who pastes both README commands at once: one HOME, so one disk cache and
            # one artifact cache that both fill; each clone its own output root.
            jobs = []
            for name, cmd in (("both-tests", ["bash", ".ci/run"]),
                              ("both-main", MAIN_JOB)):
                clone(work / name)
                jobs.append((cmd, work / name, env_for(name, "both"), work / f"{name}.log"))
            (t_rc, t_secs, t_out), (m_rc, m_secs, m_out) = run_together(jobs)
            figures.append(Figure("both", "bash .ci/run & " + " ".join(MAIN_JOB),
                                  max(t_secs, m_secs), t_rc or m_rc,
                                  f"tests {t_secs:.0f} s: {tests_detail(t_out)}; main job {m_secs:.0f} s: "
                                  f"{build_detail(m_out)}", "both green", t_rc == 0 and m_rc == 0))
            drop("both-tests", jobs[0][2])
            drop("both-main", jobs[1][2], "both")
    finally:
        if figures:
            text = "\n".join([table(figures, commit, args.fresh_home)] + profiles)
            print(text)
            if args.record:
                with open(args.record, "a") as f:
                    f.write("\n## `python3 -m tools.bench`\n\n" + text)
        if not args.keep:
            subprocess.run(["rm", "-rf", "--one-file-system", str(work)], check=False)
        else:
            print(f"[bench] kept {work}", file=sys.stderr)
    return 0 if all(f.rc == 0 and f.met is not False for f in figures) else 1


if __name__ == "__main__":
    sys.exit(run_cli(main))
