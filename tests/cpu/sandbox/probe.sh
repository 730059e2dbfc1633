#!/bin/bash
# What an action sees from inside its sandbox, one fact per line of $2 (name=yes|no), for
# test_sandbox.py. $1: a declared input (its sibling undeclared.txt is not declared); run from the
# action's runfiles directory, below its execroot.
declared=$1 out=$2
fact() { if eval "$2" >/dev/null 2>&1; then echo "$1=yes"; else echo "$1=no"; fi >>"$out"; }
: >"$out"
fact declared_readable 'test -r "$declared"'
# At its path in the execroot: unsandboxed, the execroot links every top directory of the source
# tree, so the undeclared file is there; a sandbox's execroot holds the declared inputs only.
execroot=${PWD%%/bazel-out/*}
fact execroot_found 'test "$execroot" != "$PWD" && test -d "$execroot/bazel-out"'
fact undeclared_readable 'test -r "$execroot/$(dirname "$declared")/undeclared.txt"'
# The declared input's real file lies in the source tree: writable from the action only if no
# sandbox makes everything but its outputs read-only.
src=$(readlink -f "$declared")
fact source_tree_writable 'touch "$(dirname "$src")/.kimi-k3-sandbox-probe" && rm -f "$(dirname "$src")/.kimi-k3-sandbox-probe"'
# /tmp is the action's own (--incompatible_sandbox_hermetic_tmp): at its start it holds nothing but
# the way to the source tree when that lies under /tmp (a checkout cloned into mktemp -d, which
# Bazel binds in so the inputs resolve). The host's, which the launcher binds into the sealed
# root, holds more: at least .ci/run's log.
source_under_tmp=
case $src in /tmp/*) source_under_tmp=${src#/tmp/}; source_under_tmp=${source_under_tmp%%/*} ;; esac
fact tmp_own 'test -z "$(ls -A /tmp | grep -vxF -- "$source_under_tmp")"'
# The launcher's sealed root is the action's / (pivot_root), and the host's root is nowhere.
fact root_is_sealed_root 'test -e /.kimi-k3-complete'
fact host_root_mounted 'test -e /run/kimi-k3-host/etc || test -e /run/kimi-k3-old-root/etc'
