"""The per-stack facts of @pins//:stacks.bzl, as pure functions of the lock and of the patch
folders' series (pins.bzl writes the file with them; //tests/cpu/pins:stack_facts_test runs them
on a lock with a third stack, showing that a new stack needs no Starlark edit).
"""

# The stack --//third_party:stack defaults to, and whose kernel-cache plans carry no suffix.
DEFAULT_STACK = "default"

def series_applies(text):
    """Whether a series file names a patch: a line with text before any `#` (the series format of
    tools/patch_gate/series.py read_series; tests/cpu/pins/test_stack_facts.py checks the two agree)."""
    for line in text.split("\n"):
        if line.split("#", 1)[0].strip():
            return True
    return False

def stack_facts(lock, patched):
    """The facts BUILD files need, from the lock (its `pins` and `stacks`) and `patched` (stack ->
    the roles whose series applies a patch), so that no BUILD file names a stack."""
    stacks = sorted(lock.get("stacks", {}).keys())
    if DEFAULT_STACK not in stacks:
        fail("third_party/pins.lock.json: no stack named '%s' (the default of --//third_party:stack); stacks: %s" % (
            DEFAULT_STACK,
            ", ".join(stacks),
        ))
    entries = lock["stacks"]
    return {
        "STACKS": stacks,
        "DEFAULT_STACK": DEFAULT_STACK,
        "PATCH_PINS": {s: list(entries[s].get("patch_pins", [])) for s in stacks},
        "ROLE_PINS": {
            s: {r: v for r, v in sorted(entries[s].items()) if type(v) == "string" and v in lock["pins"]}
            for s in stacks
        },
        "PATCHED": {s: sorted(patched.get(s, [])) for s in stacks},
    }

def stacks_bzl(facts):
    """The text of @pins//:stacks.bzl."""
    lines = [
        '"""Generated from third_party/pins.lock.json (and the patch folders\' <stack>.series) by',
        'tools/pins/private/pins.bzl; do not edit. Load it through //tools/pins:defs.bzl."""',
        "",
    ]
    for name in ["STACKS", "DEFAULT_STACK", "PATCH_PINS", "ROLE_PINS", "PATCHED"]:
        lines += ["%s = %s" % (name, repr(facts[name])), ""]
    return "\n".join(lines)
