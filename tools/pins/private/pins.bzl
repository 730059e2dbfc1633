"""Module extension: one lazily fetched repository per pin of third_party/pins.lock.json.

The lock is the single source of truth. Starlark only reads it to declare repositories; the
fetch, verification, cache and mirror logic is tools/fetch (tested on its own), which each
repository rule runs with the interpreter named by KIMI_K3_PYTHON. Each repository watches the
Python sources of the packages that command imports, so a changed tool re-runs it.

Each pin repository holds `file/<filename>` (target `@pins//:<pin name>`; for a `git_tree` pin
its canonical tar, which is only fetched when a target built from it is). Each pin gets only
its own entry of the lock (as a one-pin lock written into its repository), so editing one pin
re-fetches that pin alone. The hub repository `@pins` has:
  //:<pin name>        the verified file of a pin
  //stack:<role>       the file for a role (sglang, flashinfer, mooncake, ...) of the stack
                       selected with --//third_party:stack (or --config=pypi)
  //stack:<role>_pin   the pin name for that role, as a one-line text file
  //stack:wheels_torch, //stack:wheels_rest
                       the stack's `wheels` closure split for the image's layers (see below)
  //:git_pins.bzl      GIT_PINS: each git pin's repository and commit (output names that follow a pin)
  //:stacks.bzl        every per-stack fact BUILD files need, so that a stack added to the lock
                       (with its series files) needs no Starlark edit (tools/pins/defs.bzl loads it):
                         STACKS         the lock's stack names (the values of --//third_party:stack)
                         DEFAULT_STACK  the stack named "default": the flag's default, and the one
                                        whose kernel-cache plans carry no ".<stack>" suffix
                         PATCH_PINS     stack -> the GitHub-only patch pins its series need
                         ROLE_PINS      stack -> role (sglang, flashinfer, torch, ...) -> pin name
                         PATCHED        stack -> the patch folders (role -> folder, the `pins.lock`
                                        tag's patch_dirs) whose <stack>.series applies something;
                                        the others' pinned wheel goes into the image unchanged

The `debian` extension does the same for third_party/debian.lock.json: one lazily fetched
repository per set,
`@debian_<set>` (dashes as underscores), holding the set's own entry as a one-set lock and a flat
apt repository of its verified .debs (`python3 -m tools.fetch.debian repo`):
  //:lock              set.lock.json (only this set: editing another set re-fetches nothing here)
  //:repo              repo/Packages and the .debs (mmdebstrap's only mirror, tools/image/rootfs.py)
  //:cache_root        the artifact cache root ($KIMI_K3_CACHE when fetched), for actions
"""

load(":fetch.bzl", "FETCH_ENVIRON", "fetch_pin_file", "tool_env", "tool_python", "watch_python_sources")
load(":stack_facts.bzl", "series_applies", "stack_facts", "stacks_bzl")

def _repo_name(pin):
    return "pin_" + "".join([c if c.isalnum() else "_" for c in pin.elems()])

def _pinned_file_impl(rctx):
    rctx.file("pin.lock.json", rctx.attr.pin_json)
    fetch_pin_file(rctx, "pin.lock.json", rctx.attr.pin, "file/" + rctx.attr.filename, archive = rctx.attr.archive)
    rctx.file("file/BUILD.bazel", 'exports_files(["{f}"])\nfilegroup(name = "file", srcs = ["{f}"], visibility = ["//visibility:public"])\n'.format(f = rctx.attr.filename))
    rctx.file("BUILD.bazel", "")

_pinned_file = repository_rule(
    implementation = _pinned_file_impl,
    attrs = {
        "pin": attr.string(mandatory = True),
        "pin_json": attr.string(mandatory = True),
        "filename": attr.string(mandatory = True),
        "archive": attr.bool(doc = "a git_tree pin: its tar, not its files"),
    },
    environ = FETCH_ENVIRON,
)

# The image's wheel layers (image/BUILD.bazel), bottom first: `torch` (torch, triton and
# NVIDIA's CUDA library wheels: the largest and rarest to change) below `rest` (the other
# third-party wheels of the stack's closure). The stack's own sglang, flashinfer and mooncake
# pins are in neither: they get their own layers (patched, or pinned separately).
_OWN_LAYER_ROLES = ["sglang", "flashinfer", "mooncake"]

def _in_torch_layer(package_name):
    n = package_name.lower().replace("_", "-").replace(".", "-")
    if n in ["torch", "triton"]:
        return True

    # nvidia-cutlass-dsl* follow FlashInfer/SGLang releases, not torch's: keep them in `rest`
    # so an SGLang bump does not rebuild the multi-GB torch layer.
    return n.startswith("nvidia-") and not n.startswith("nvidia-cutlass-dsl")

def _wheel_groups(lock, stacks):
    """//stack:wheels_torch and //stack:wheels_rest (filegroups selected by the stack flag)."""
    lines = []
    groups = {"torch": {}, "rest": {}}
    for sname in sorted(stacks.keys()):
        stack = stacks[sname]
        own = [stack.get(r) for r in _OWN_LAYER_ROLES]
        members = {"torch": [], "rest": []}
        for pin in stack.get("wheels", []):
            if pin in own or pin not in lock["pins"]:
                continue
            name = lock["pins"][pin].get("package", {}).get("name", pin)
            members["torch" if _in_torch_layer(name) else "rest"].append("//:" + pin)
        setting = "@@//third_party:stack_is_" + sname
        for group in ["torch", "rest"]:
            target = "wheels_%s_%s" % (group, sname)
            lines.append("filegroup(name = %s, srcs = %s)" % (repr(target), repr(sorted(members[group]))))
            groups[group][setting] = ":" + target
    for group in ["torch", "rest"]:
        lines.append('alias(name = "wheels_%s", actual = select(%s, no_match_error = "stack has no wheels list"))' % (group, repr(groups[group])))
    return lines

def _hub_impl(rctx):
    lock = json.decode(rctx.attr.lock_json)
    build = ['package(default_visibility = ["//visibility:public"])', "", 'exports_files(["stacks.bzl", "git_pins.bzl"])', ""]
    for pin in sorted(lock["pins"].keys()):
        build.append('alias(name = "%s", actual = "@%s//file")' % (pin, _repo_name(pin)))
    rctx.file("BUILD.bazel", "\n".join(build) + "\n")

    stacks = lock.get("stacks", {})
    roles = {}
    for stack in stacks.values():
        for role, value in stack.items():
            if type(value) == "string" and value in lock["pins"]:
                roles[role] = True
    sbuild = ['package(default_visibility = ["//visibility:public"])', ""]
    for role in sorted(roles.keys()):
        files = {}
        names = {}
        for sname in sorted(stacks.keys()):
            pin = stacks[sname].get(role)
            setting = "@@//third_party:stack_is_" + sname
            if pin in lock["pins"]:
                files[setting] = "//:" + pin
                names[setting] = ":%s_pin_%s" % (role, sname)
                sbuild.append('genrule(name = "%s_pin_%s", outs = ["%s_pin_%s.txt"], cmd = "echo %s > $@")' % (role, sname, role, sname, pin))
        sbuild.append('alias(name = "%s", actual = select(%s, no_match_error = "stack has no %s pin"))' % (role, repr(files), role))
        sbuild.append('alias(name = "%s_pin", actual = select(%s, no_match_error = "stack has no %s pin"))' % (role, repr(names), role))
    sbuild += _wheel_groups(lock, stacks)
    rctx.file("stack/BUILD.bazel", "\n".join(sbuild) + "\n")

    rctx.file("stacks.bzl", stacks_bzl(stack_facts(lock, json.decode(rctx.attr.patched_json))))

    # The git pins' ids, for targets whose output names follow a pin (FlashKDA's wheel version).
    git_pins = {}
    for pin, spec in sorted(lock["pins"].items()):
        if spec["kind"] in ["git_diff", "git_tree"]:
            git_pins[pin] = {"repository": spec["repository"], "commit": spec["commit"]}
    rctx.file("git_pins.bzl", "# Generated from third_party/pins.lock.json by the pins extension.\nGIT_PINS = %s\n" % json.encode_indent(git_pins))

_hub = repository_rule(
    implementation = _hub_impl,
    attrs = {
        "lock_json": attr.string(mandatory = True),
        "patched_json": attr.string(mandatory = True, doc = "stack -> roles whose series applies a patch"),
    },
)

def _patched(mctx, lock, patch_dirs):
    """stack -> the roles of patch_dirs (role -> package) whose <package>/<stack>.series applies."""
    result = {}
    for stack in sorted(lock.get("stacks", {}).keys()):
        result[stack] = []
        for role, package in sorted(patch_dirs.items()):
            label = Label("%s:%s.series" % (package, stack))
            path = mctx.path(label)
            if not path.exists:
                fail("stack '%s' of third_party/pins.lock.json has no %s/%s.series: every stack needs a series in each patch folder (without entries, and a comment saying why, when nothing applies)" % (
                    stack,
                    package.lstrip("/"),
                    stack,
                ))
            if series_applies(mctx.read(label)):
                result[stack].append(role)
    return result

def _pins_impl(mctx):
    for mod in mctx.modules:
        for tag in mod.tags.lock:
            text = mctx.read(tag.file)
            lock = json.decode(text)
            patched = _patched(mctx, lock, tag.patch_dirs)
            for pin, spec in lock["pins"].items():
                _pinned_file(
                    name = _repo_name(pin),
                    pin = pin,
                    filename = spec.get("filename", pin),
                    archive = spec["kind"] == "git_tree",
                    pin_json = json.encode_indent({"schema_version": lock.get("schema_version", 1), "pins": {pin: spec}, "stacks": {}}),
                )
            _hub(name = "pins", lock_json = text, patched_json = json.encode(patched))

pins = module_extension(
    implementation = _pins_impl,
    tag_classes = {"lock": tag_class(attrs = {
        "file": attr.label(mandatory = True),
        "patch_dirs": attr.string_dict(doc = "role -> the patch folder (package) holding <stack>.series for that role's pin"),
    })},
)


def _debian_repo_name(set_name):
    return "debian_" + "".join([c if c.isalnum() else "_" for c in set_name.elems()])

def _debian_set_impl(rctx):
    python = tool_python(rctx)
    rctx.file("set.lock.json", rctx.attr.set_json)
    watch_python_sources(rctx)
    args = [python, "-m", "tools.fetch.debian", "repo", "--lock", "set.lock.json", "--set", rctx.attr.set, "--out", "repo"]
    env = tool_env(rctx)
    rctx.report_progress("fetching the .debs of Debian set %s" % rctx.attr.set)
    res = rctx.execute(args, environment = env, timeout = 7200, quiet = False)
    if res.return_code != 0:
        # tools.fetch.debian prints a one-line `error: ...` naming the package and the fix.
        fail("Debian set '%s': %s" % (rctx.attr.set, (res.stderr.strip().splitlines() or ["fetch failed"])[-1]))
    # Actions run without the user's environment: the cache root they keep derived files under
    # (the rootfs tars) is recorded here, from the one function that defines it.
    res = rctx.execute([python, "-c", "from tools.common.cache import cache_root; print(cache_root().absolute())"],
                       environment = env)
    if res.return_code != 0:
        fail("Debian set '%s': cannot compute the cache root: %s" % (rctx.attr.set, res.stderr.strip()))
    rctx.file("cache_root.txt", res.stdout.strip() + "\n")
    rctx.file("BUILD.bazel", "\n".join([
        'package(default_visibility = ["//visibility:public"])',
        'exports_files(["set.lock.json", "cache_root.txt"])',
        'filegroup(name = "lock", srcs = ["set.lock.json"])',
        'filegroup(name = "repo", srcs = ["repo/Packages"] + glob(["repo/*.deb"]))',
        'filegroup(name = "cache_root", srcs = ["cache_root.txt"])',
        "",
    ]))

_debian_set = repository_rule(
    implementation = _debian_set_impl,
    attrs = {
        "set": attr.string(mandatory = True),
        "set_json": attr.string(mandatory = True),
    },
    environ = FETCH_ENVIRON,
)

def _debian_impl(mctx):
    for mod in mctx.modules:
        for tag in mod.tags.lock:
            lock = json.decode(mctx.read(tag.file))
            for set_name in sorted(lock["sets"].keys()):
                _debian_set(
                    name = _debian_repo_name(set_name),
                    set = set_name,
                    set_json = json.encode_indent({"schema_version": lock["schema_version"], "sets": {set_name: lock["sets"][set_name]}}),
                )

debian = module_extension(
    implementation = _debian_impl,
    tag_classes = {"lock": tag_class(attrs = {"file": attr.label(mandatory = True)})},
)
