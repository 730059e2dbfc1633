"""The per-stack facts for BUILD files (generated into @pins//:stacks.bzl from the lock and the
patch folders' series by tools/pins/private/pins.bzl) and select() over the stack flag, so that
no BUILD file names a stack: a stack added to third_party/pins.lock.json needs no Starlark edit.

    STACKS, DEFAULT_STACK, PATCH_PINS, ROLE_PINS, PATCHED   see tools/pins/private/pins.bzl
    stack_setting(stack)        the config_setting of --//third_party:stack=<stack>
    stack_select(per_stack)     select() giving per_stack[<the selected stack>]
    patched(stack, role)        whether the stack's series for `role` applies a patch (its image
                                gets the patched, repacked wheel; else the pinned wheel as is)
    patched_select(role, if_patched, if_pinned)   select() of one of the two by patched()
"""

load("@pins//:stacks.bzl", _DEFAULT_STACK = "DEFAULT_STACK", _PATCHED = "PATCHED", _PATCH_PINS = "PATCH_PINS", _ROLE_PINS = "ROLE_PINS", _STACKS = "STACKS")

STACKS = _STACKS
DEFAULT_STACK = _DEFAULT_STACK
PATCH_PINS = _PATCH_PINS
ROLE_PINS = _ROLE_PINS
PATCHED = _PATCHED

def stack_setting(stack):
    return Label("//third_party:stack_is_" + stack)

def stack_select(per_stack):
    """select() on --//third_party:stack: per_stack (stack -> value) must name every stack."""
    missing = [s for s in STACKS if s not in per_stack]
    if missing:
        fail("stack_select: no value for stacks %s" % missing)
    return select({stack_setting(s): per_stack[s] for s in STACKS})

def patched(stack, role):
    return role in PATCHED[stack]

def patched_select(role, if_patched, if_pinned):
    return stack_select({s: if_patched if patched(s, role) else if_pinned for s in STACKS})
