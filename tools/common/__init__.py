"""The ground package: what every stage uses, written once.

- errors: UserError (one line naming the input and the fix) and run_cli (exit 2, no traceback)
- hashing: sha256 of files and bytes
- files: atomic writes (a temp sibling, then a rename: readers never see half a file)
- jsonfmt: the two JSON encodings, each named for what it is for, and the parser that refuses a
  key twice (loads_unique_keys)
- jsondata: the one reader of JSON data files (load_json_file): read, parse (a key twice
  refused), check a declarative schema of types; each error one line naming the flag, the file
  and the JSON path
- cache: the artifact cache root every stage shares
- credentials: the credentials in URLs of the variables tools/bazel forwards, kept out of Bazel
  (stripped for it, restored in the tools that make the requests)
- progress: progress of long work (done/total, rate, ETA) on stderr
- cliargs: repeated `--flag NAME=PATH` values as one dict (named_paths; a name twice refused)

Standard library only: repository rules run these files before any venv exists.
"""
