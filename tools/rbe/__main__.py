"""python3 -m tools.rbe up --workers N [--port 50051] | status | down | config
    | image --out DIR [--push HOST[:PORT]/PATH] [--tag T]"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from tools.common.errors import run_cli
from tools.rbe import cluster, config, exec_image


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.rbe", description="the loopback REAPI cluster (BuildGrid, "
                                 "PostgreSQL, buildbox) that tools/bazel --config=rbe uses")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("up", help="start the cluster (provisions its root and venv on first use)")
    p.add_argument("--workers", type=int, default=2, help="buildbox workers, one action each (default 2)")
    p.add_argument("--port", type=int, default=config.DEFAULT_PORT, help="gRPC port on 127.0.0.1 (default %(default)s)")
    p.add_argument("--instance", default=config.DEFAULT_INSTANCE, help="REAPI instance name (default %(default)s)")
    p.add_argument("--bots-remote", help="the Bots service the workers register with (default: this cluster's)")
    sub.add_parser("down", help="stop the cluster: nothing left running, listening or mounted")
    sub.add_parser("status", help="whether a cluster is up, its processes and their RSS")
    p = sub.add_parser("config", help="print the BuildGrid config `up` would write")
    p.add_argument("--port", type=int, default=config.DEFAULT_PORT)
    p.add_argument("--instance", default=config.DEFAULT_INSTANCE)
    p = sub.add_parser("image", help="the exec root (what a worker's actions see) as an OCI image, for a hosted "
                       "REAPI engine (tools/rbe/exec_image.py)")
    p.add_argument("--out", required=True, type=Path, help="OCI layout directory to write (new or empty)")
    p.add_argument("--push", metavar="HOST[:PORT]/PATH", help="push it there by digest and print its "
                   "container-image exec property")
    p.add_argument("--tag", action="append", default=[], help="tags written after the push is verified (with --push)")
    p.add_argument("--authfile", type=Path, help="docker/containers auth file for --push")
    p.add_argument("--source-date-epoch", default=None, help="the layers' mtime (default: $SOURCE_DATE_EPOCH, "
                   "else image/constants.bzl's)")
    args = ap.parse_args(argv)
    if args.command == "up":
        status = cluster.up(args.workers, args.port, args.instance, args.bots_remote)
        print(f"rbe: cluster up in {status['start_s']} s: grpc://127.0.0.1:{args.port}, instance {args.instance}, "
              f"{args.workers} workers; `tools/bazel build --config=rbe ...`; stop: python3 -m tools.rbe down",
              file=sys.stderr)
        print(json.dumps(status, sort_keys=True))
    elif args.command == "down":
        print(f"rbe: {cluster.down()}", file=sys.stderr)
    elif args.command == "status":
        r = cluster.running(cluster.layout())
        if r is None:
            # A cluster that died on its own says why in its status file (a process that exited).
            last = cluster.last_status(cluster.layout())
            why = f" (the last one failed: {last['error']})" if last.get("state") == "failed" and last.get("error") else ""
            print(f"rbe: no cluster is up{why}", file=sys.stderr)
            return 1
        procs = cluster.processes(r.pid)
        print(f"rbe: up: grpc://127.0.0.1:{r.port}, instance {r.instance}, {r.workers} workers, "
              f"{len(procs)} processes, PSS {sum(p[3] for p in procs) / 1024:.0f} MB "
              f"(RSS summed {sum(p[2] for p in procs) / 1024:.0f} MB)", file=sys.stderr)
        print("pid\tprocess\tRSS MB\tPSS MB")
        for pid, name, rss, pss in procs:
            print(f"{pid}\t{name}\t{rss / 1024:.1f}\t{pss / 1024:.1f}")
    elif args.command == "config":
        sys.stdout.write(config.bgd_config(cluster.layout(), args.port, args.instance))
    elif args.command == "image":
        return exec_image.image_cli(args.out, args.push, args.tag, args.authfile, args.source_date_epoch)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
